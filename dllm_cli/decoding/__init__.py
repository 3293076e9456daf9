"""The decoding engine: canvas, sampling, unmasking rules, cache policies and the loop.

    engine = Engine(model, special, settings, slots=8)   # requests as they come (engine.py)
    rid = engine.add(prompt_ids); out = engine.step()    # out.finished: final answers
    run = decode_steps(model, special, prompts, settings)  # one static batch (run.py)
    for event in run: ...
    result = run.result()                  # or: decode(model, special, prompts, settings)

Choices worth knowing (details in each module and docs/decoding.md):
- Blocks and steps that do not divide are adjusted, not refused (settings.py, canvas.py).
- Every policy predicts the block from fresh hidden states (one column early for Dream); no
  block's first token is ever force-committed (Fast-dLLM issue #61).
- Classifier-free guidance's prompt-masked branch is extra rows with their own cache rows.
- [MASK] is never a draft; logits past the real vocabulary are ignored (sampling.py).
- Answers equal single-prompt decodes under greedy decoding, static or continuous admission.
- Dream's `fixed` schedule counts each row's own masks (Dream averages over the batch);
  confidence ties go to the leftmost column.
"""

from dllm_cli.decoding.answer import answer_end, answer_length, answer_tokens, first_stop
from dllm_cli.decoding.engine import Engine, StepOutput
from dllm_cli.decoding.events import DecodeResult, RowCommit, RowPhase, StepEvent
from dllm_cli.decoding.guided import GuidedCommitter
from dllm_cli.decoding.request import Finished, Request
from dllm_cli.decoding.run import Decoder, DecodeRun, decode, decode_steps, open_engine
from dllm_cli.decoding.unmask import Committer, Decision, StepContext

__all__ = [
    "Committer",
    "Decision",
    "DecodeResult",
    "DecodeRun",
    "Decoder",
    "Engine",
    "Finished",
    "GuidedCommitter",
    "Request",
    "RowCommit",
    "RowPhase",
    "StepContext",
    "StepEvent",
    "StepOutput",
    "answer_end",
    "answer_length",
    "answer_tokens",
    "decode",
    "decode_steps",
    "first_stop",
    "open_engine",
]
