"""TinyGSM: deterministic data, a disjoint held-out split, an exact checker, a round-tripping
tokenizer, and a training command that learns and writes loadable checkpoints."""

from __future__ import annotations

import itertools
import json
import operator
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as safe_load
from transformers import AutoModelForCausalLM, AutoTokenizer

from dllm_cli.models.loading import load_model
from recipes.tinygsm.architectures import ar_to_llada, build_ar, build_llada
from recipes.tinygsm.batches import Encoder, ExampleSource, masked_batch
from recipes.tinygsm.data import (
    MAX_VALUE,
    extract_answer,
    few_shot_prompt,
    generate_problem,
    is_correct,
    random_fact,
    shots_for,
    train_stream,
)
from recipes.tinygsm.data import (
    test_split as held_out,
)
from recipes.tinygsm.phases import ar_loss
from recipes.tinygsm.quickeval import eval_ar
from recipes.tinygsm.tokenizer import SPECIALS, build_tokenizer, save_tokenizer
from recipes.tinygsm.train import PRESETS, train

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def test_generator_is_deterministic_for_a_seed():
    a = [generate_problem(random.Random(7)) for _ in range(3)]
    b = [generate_problem(random.Random(7)) for _ in range(3)]
    assert a == b
    assert list(itertools.islice(train_stream(3), 50)) == list(
        itertools.islice(train_stream(3), 50)
    )
    assert list(itertools.islice(train_stream(3), 5)) != list(itertools.islice(train_stream(4), 5))


def test_problems_are_consistent_and_small():
    rng = random.Random(0)
    for _ in range(500):
        p = generate_problem(rng)
        equations = [s for s in p.solution.split(". ") if "=" in s]
        assert 1 <= len(equations) <= 3
        value = None
        for eq in equations:
            lhs, rhs = eq.rstrip(".").split(" = ")
            a, op, b = lhs.split(" ")[-3:]
            assert int(rhs) == OPS[op](int(a), int(b))
            if op == "/":
                assert int(a) % int(b) == 0
            assert 0 <= int(rhs) <= MAX_VALUE
            if value is not None:
                assert int(a) == value  # each step starts from the previous result
            value = int(rhs)
        assert p.answer == value
        assert p.solution.endswith(f"The answer is {p.answer}.")


def test_held_out_split_is_fixed_distinct_and_never_trained_on():
    split = held_out()
    assert len(split) == 1000 and len({p.question for p in split}) == 1000
    assert split == held_out()  # cached and fixed
    questions = {p.question for p in split}
    # the training stream is drawn from the same generator but filters the held-out questions
    seen = [p.question for p in itertools.islice(train_stream(0), 20000)]
    assert not questions.intersection(seen)
    assert not questions.intersection(q.question for i in range(50) for q in shots_for(i, 8))


def test_checker_accepts_exactly_the_right_answer():
    assert is_correct("3 + 4 = 7. The answer is 7.", 7)
    assert not is_correct("The answer is 70.", 7)
    assert not is_correct("The answer is 17.", 7)
    assert not is_correct("The answer is 7", 7)  # the answer line ends with a period
    assert not is_correct("7", 7)
    assert not is_correct("", 7)
    assert is_correct("The answer is 7. The answer is 8.", 7)  # the first answer line counts
    assert not is_correct("The answer is 8. The answer is 7.", 7)
    assert extract_answer("blah The answer is 42. more") == 42
    assert extract_answer("no answer here") is None


def test_drill_facts_are_true_equations():
    rng = random.Random(1)
    for _ in range(300):
        lhs, rhs = random_fact(rng).rstrip(".").split(" = ")
        a, op, b = lhs.split(" ")
        assert OPS[op](int(a), int(b)) == int(rhs)


def test_tokenizer_round_trips_prompts_and_answers(tmp_path):
    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert [tok.convert_tokens_to_ids(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    assert tok.mask_token == "<|mdm_mask|>" and tok.eos_token == "<|endoftext|>"
    for i, p in enumerate(held_out()[:200]):
        text = few_shot_prompt(p.question, shots_for(i, i % 4)) + "\n" + p.solution
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    digits = tok.tokenize(" 1234")
    assert digits == ["▁1", "2", "3", "4"]  # one token per digit


def test_chat_template_is_llada_style(tmp_path):
    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_masked_batches_mask_only_answers_and_weight_by_one_over_t():
    tok = build_tokenizer()
    enc = Encoder(tok)
    src = ExampleSource(enc, seed=5)
    items = [src.take(k) for k in (0, 1, 2, 0)]
    length = max(len(e.prompt) for e in items) + 96
    batch = masked_batch(items, length, enc.ids, random.Random(0), aligned_frac=0.5)
    for row, e in enumerate(items):
        p = len(e.prompt)
        prompt_noisy = batch.noisy[row, :p]
        assert torch.equal(prompt_noisy, batch.target[row, :p])  # shots not masked by default
        masked = batch.noisy[row] == enc.ids.mask
        assert masked[p:].any()
        assert torch.all((batch.weight[row] > 0) == masked)  # loss exactly on masked tokens
        assert batch.weight[row][masked].min() >= 1.0 / len(e.answer) - 1e-6  # 1/t >= 1
        eos_fill = batch.target[row, p + len(e.answer) :]
        assert torch.all(eos_fill == enc.ids.eos)  # answers padded with EOS


def test_ar_weights_map_onto_llada_exactly():
    tok = build_tokenizer()
    cfg = PRESETS["micro"]
    ar, mdm = build_ar(cfg, tok).eval(), build_llada(cfg, tok).eval()
    mdm.load_state_dict(ar_to_llada(ar.state_dict()))  # strict: every name maps
    x = torch.randint(0, 100, (2, 1))  # one token: causal and bidirectional agree
    with torch.no_grad():
        torch.testing.assert_close(ar(input_ids=x).logits, mdm(x))


def test_micro_training_lowers_the_loss_and_writes_loadable_checkpoints(tmp_path):
    cfg = replace(PRESETS["micro"], ar_steps=25, dream_steps=4, llada_steps=4, warmup=2, ar_lr=1e-2)
    tok = build_tokenizer()
    enc = Encoder(tok)
    torch.manual_seed(cfg.seed)
    fresh = build_ar(cfg, tok).eval()  # the same initial weights train() starts from
    probe = 10**6  # a batch index training never uses
    with torch.no_grad():
        before = ar_loss(fresh, cfg, enc, probe).item()
    result = train(cfg, tmp_path)
    assert set(result) == {"ar", "dream", "llada"}
    guide = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-gsm-ar").eval()
    with torch.no_grad():
        after = ar_loss(guide, cfg, enc, probe).item()
        shipped_accuracy = eval_ar(guide, enc, n=cfg.eval_n * 2)
    assert after < before - 0.5
    # the accuracies it reports and records are those of the weights it wrote
    assert result["ar"]["accuracy"] == shipped_accuracy
    for phase, folder in (
        ("ar", "tiny-gsm-ar"),
        ("dream", "tiny-gsm-dream"),
        ("llada", "tiny-gsm"),
    ):
        record = json.loads((tmp_path / folder / "training.json").read_text())
        assert record["final_0shot"] == result[phase]
    for folder, kind in (("tiny-gsm", "llada"), ("tiny-gsm-dream", "Dream")):
        loaded = load_model(tmp_path / folder, device="cpu")
        assert loaded.architecture == kind
        assert loaded.special.mask == tok.mask_token_id
        assert loaded.special.vocab == len(tok)
        record = json.loads((tmp_path / folder / "training.json").read_text())
        assert record["init"] == "AR guide weights (tiny-gsm-ar)"
    assert not (tmp_path / "work").exists()


def test_resume_continues_to_the_same_weights(tmp_path, monkeypatch):
    cfg = replace(
        PRESETS["micro"], ar_steps=8, dream_steps=4, llada_steps=4, checkpoint_every=4, eval_n=2
    )
    train(cfg, tmp_path / "straight")

    import recipes.tinygsm.phases as train_module

    original = train_module.save_checkpoint

    def save_then_stop(*args, **kwargs):  # Ctrl-C right after the first checkpoint (AR step 4)
        original(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "resumed")
    monkeypatch.setattr(train_module, "save_checkpoint", original)
    train(cfg, tmp_path / "resumed", resume=True)
    for name in ("tiny-gsm", "tiny-gsm-ar", "tiny-gsm-dream"):
        a = safe_load(tmp_path / "straight" / name / "model.safetensors")
        b = safe_load(tmp_path / "resumed" / name / "model.safetensors")
        assert a.keys() == b.keys()
        for key, tensor in a.items():
            assert torch.equal(tensor, b[key]), key


SHIPPED = Path(__file__).resolve().parents[3] / "dllm_cli" / "tinygsm" / "weights"
needs_shipped = pytest.mark.skipif(
    not all((SHIPPED / n / "model.safetensors").is_file() for n in ("tiny-gsm", "tiny-gsm-dream")),
    reason="the shipped TinyGSM weights are not in this checkout",
)


@pytest.mark.slow
@needs_shipped
def test_shipped_models_load_through_the_public_loader():
    """Each shipped diffusion model loads as its family's real checkpoints do, and the guide's
    vocabulary extends each one's (append-only tokenizer: shared ids mean the same string)."""
    guide = AutoModelForCausalLM.from_pretrained(SHIPPED / "tiny-gsm-ar")
    guide_vocab = AutoTokenizer.from_pretrained(SHIPPED / "tiny-gsm-ar").get_vocab()
    families = {"tiny-gsm": ("llada", "model.transformer.wte.weight")}
    families["tiny-gsm-dream"] = ("Dream", "model.embed_tokens.weight")
    for name, (family, embedding) in families.items():
        loaded = load_model(f"builtin:{name}", device="cpu")
        assert loaded.architecture == family
        assert embedding in set(loaded.model.state_dict())
        vocab = loaded.tokenizer.get_vocab()
        assert all(guide_vocab.get(piece) == i for piece, i in vocab.items()), name
        assert loaded.special.vocab <= guide.config.vocab_size
    dream = load_model("builtin:tiny-gsm-dream", device="cpu")
    assert dream.model.config.vocab_size == guide.config.vocab_size  # adapted from the guide
    total = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert total < 40 * 2**20
