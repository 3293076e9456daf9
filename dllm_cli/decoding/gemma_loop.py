"""transformers' DiffusionGemma `generate` loop as a generator: one denoising step per `next`.

transformers runs a whole decode inside `generate` and reports through a streamer, which can
watch the loop but not pause it. So this is the loop of `DiffusionGemmaGenerationMixin.generate`
(transformers 5.24, models/diffusion_gemma/generation_diffusion_gemma.py, its steps 0.b-2)
calling the model's own `_prepare_*`, encoder, `_denoising_step` and `_finalize_canvas` pieces
and the streamer in the same order with the same arguments; only the control flow is dllm's
(it suspends after each denoising step, so no worker thread is needed), and it hands each
finished canvas, with the logits that committed it, to `on_canvas` (answer logprobs), after
`choose` (a grammar, gemma_grammar.py) has picked its tokens where one is given.

Left out, because dllm never passes them (gemma.py): a cache passed in, compiled static caches,
images, a caller's starting canvas or self-conditioning logits, caller-supplied processors and
stopping criteria, `tokens_per_forward`; nor are masks prepared for a canvas that never comes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator

import torch
import torch.nn.functional as F


@torch.no_grad()  # as generate; torch's decorator sets the mode around each resume only
def denoise(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    config,
    sampler,
    stopping,
    streamer,
    on_canvas: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Generator[None, None, torch.Tensor]:
    """Decode (B, W) left-padded prompts; yields after every denoising step but the last, returns
    generate's (B, W + canvases * L) `sequences`. `config`: the resolved generation config,
    `stopping`: the diffusion stopping rule (or None), `streamer`: takes generate's calls;
    `on_canvas(canvas, logits)`: each finished (B, L) canvas before its stop-token padding,
    with the (B, L, V) processed logits of the step that committed each row's canvas;
    `choose(canvas, logits)`: the canvas kept instead of the argmax one (a grammar's picks,
    gemma_grammar.py; None: the argmax, as generate keeps it)."""
    batch_size, cur_len = input_ids.shape
    max_length, max_new_tokens = model._prepare_generated_length(config, cur_len)
    canvases = math.ceil(max_new_tokens / model.config.canvas_length)
    device, canvas_length = input_ids.device, model.config.canvas_length
    finished_sequences = torch.zeros(batch_size, dtype=torch.bool, device=device)
    cache = model._prepare_cache_for_generation(
        generation_config=config, batch_size=batch_size, max_length=max_length
    )
    eos_tensor = None
    if config.eos_token_id is not None:
        eos_tensor = torch.tensor(config.eos_token_id, device=device)
    encoder_position_ids = torch.arange(0, cur_len, dtype=torch.int32, device=device)[None]
    decoder_position_ids = torch.arange(
        cur_len, cur_len + canvas_length, dtype=torch.int32, device=device
    )[None]
    attention_mask = attention_mask.bool()  # (B, W)
    decoder_attention_mask = F.pad(attention_mask, (0, canvas_length), value=True)
    logits_processor = model._prepare_logits_processor(config, None)
    ar_stopping = model._prepare_ar_stopping_criteria(config, None)
    model_kwargs: dict = {}  # generate's leftovers after attention_mask: none here
    streamer.put(input_ids.cpu())

    is_prefill = True
    for canvas in range(canvases):
        # 1.a the encoder reads the prompt (first canvas) or the last finished canvas
        tokens, encoder_masks = model._prepare_encoder_inputs(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_position_ids=encoder_position_ids,
            cache=cache,
            is_prefill=is_prefill,
            canvas_length=canvas_length,
            batch_size=batch_size,
        )
        cache = model.model.encoder(
            input_ids=tokens, attention_mask=encoder_masks, cache=cache,
            position_ids=encoder_position_ids,
        ).cache  # fmt: skip
        is_prefill = False
        # 1.b a random canvas, its decoder masks, a fresh stopping rule
        current, self_conditioning, masks, finished_denoising = model._prepare_denoiser_inputs(
            decoder_attention_mask=decoder_attention_mask,
            cache=cache,
            sampler=sampler,
            diffusion_stopping_criteria=stopping,
            batch_size=batch_size,
            device=device,
            model_kwargs=model_kwargs,
        )
        argmax_canvas = current
        # 1.c the denoising steps, N..1
        for cur_step in reversed(range(1, config.max_denoising_steps + 1)):
            current, argmax_canvas, self_conditioning, finished_denoising = model._denoising_step(
                decoder_forward=model.forward,
                current_canvas=current,
                argmax_canvas=argmax_canvas,
                input_ids=input_ids,
                decoder_position_ids=decoder_position_ids,
                self_conditioning_logits=self_conditioning,
                mask_mapping=masks,
                cache=cache,
                finished_denoising=finished_denoising,
                cur_step=cur_step,
                sampler=sampler,
                logits_processor=logits_processor,
                diffusion_stopping_criteria=stopping,
            )
            streamer.put_draft(value=argmax_canvas.cpu())
            if torch.all(finished_denoising):
                break
            if cur_step > 1:
                yield  # the canvas goes on
        if choose is not None:  # dllm's: structured output picks the kept tokens
            argmax_canvas = choose(argmax_canvas, self_conditioning)
        if on_canvas is not None:  # a row the stopping rule froze kept its step's logits
            on_canvas(argmax_canvas, self_conditioning)
        # 1.d-e the canvas joins the sequence; rows that met a stop token are padded after it
        input_ids = torch.cat([input_ids, argmax_canvas], dim=-1)
        input_ids, finished_sequences = model._finalize_canvas(
            input_ids=input_ids,
            finished_sequences=finished_sequences,
            generation_config=config,
            stopping_criteria=ar_stopping,
            canvas_length=canvas_length,
            eos_tensor=eos_tensor,
        )
        streamer.put(input_ids[:, -canvas_length:].cpu())
        if torch.all(finished_sequences) or canvas + 1 == canvases:
            break
        # 1.f the next canvas's masks and positions
        (
            cur_len,
            decoder_attention_mask,
            attention_mask,
            encoder_position_ids,
            decoder_position_ids,
        ) = model._prepare_kwargs_for_next_canvas(
            attention_mask=attention_mask,
            decoder_attention_mask=decoder_attention_mask,
            decoder_position_ids=decoder_position_ids,
            canvas_length=canvas_length,
            cur_len=cur_len,
        )
        yield  # the canvas's last step
    streamer.end()
    return input_ids
