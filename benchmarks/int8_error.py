"""Where int8's error comes from on the shipped model (issue 30; an analysis, not a test).

    python benchmarks/int8_error.py

One forward of 16 held-out questions (narrow split) plus 64 masks each, float32 against W8A8:
first each projection alone (its float32 input, its output error relative to float32's),
then the logits at the masked columns with one kind of layer at a time kept in float32.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dllm_cli.models.quantize import Int8Linear
from dllm_cli.problems import builtin_problems
from dllm_cli.runtime import open_runtime


def canvas(rt, n: int = 16, gen: int = 64) -> torch.Tensor:
    """(n, T) left-padded chat prompts followed by `gen` masks."""
    ids = [rt.prepare(p.question) for p in builtin_problems("narrow")[:n]]
    width = max(map(len, ids))
    pad, mask = rt.loaded.special.pad, rt.loaded.special.mask
    return torch.tensor([[pad] * (width - len(i)) + i + [mask] * gen for i in ids])


def unfused(model: nn.Module) -> nn.Module:
    """The separate linears run (fused groups are the same arithmetic, one GEMM)."""
    for m in model.modules():
        if m.__dict__.get("fusion") is not None:
            m.fusion = None
    return model


def per_layer(model: nn.Module, x: torch.Tensor) -> None:
    """Each projection's relative output error under W8A8, on its own float32 input."""
    rows = {}

    def hook(name):
        def record(mod, args, out):
            a = args[0].reshape(-1, args[0].shape[-1]).float()
            want = a @ mod.weight.float().t()
            got = Int8Linear.of(mod.weight)(a)
            peak = a.abs().amax(0)  # per input channel
            rows[name] = ((got - want).norm() / want.norm(), peak.max() / peak.median())

        return record

    hooks = [
        m.register_forward_hook(hook(n)) for n, m in model.named_modules() if type(m) is nn.Linear
    ]
    with torch.inference_mode():
        model(x)
    for h in hooks:
        h.remove()
    print("| projection | relative error | input max / median channel peak |\n|---|---|---|")
    for name, (err, ratio) in rows.items():
        print(f"| {name} | {err:.4f} | {ratio:.1f} |")


def logits_error(model: nn.Module, x: torch.Tensor, mask: int, keep) -> str:
    """KL(float32 || int8) and argmax agreement at the masked columns, `keep(name)` in float."""
    q = copy.deepcopy(model)
    for parent_name, parent in list(q.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}".lstrip(".")
            if type(child) is nn.Linear and not keep(full):
                setattr(parent, name, Int8Linear.of(child.weight, child.bias))
    with torch.inference_mode():
        want, got = model(x), q(x)
    at = x == mask
    kl = torch.nn.functional.kl_div(
        got[at].log_softmax(-1), want[at].log_softmax(-1), log_target=True, reduction="batchmean"
    )
    agree = (got.argmax(-1)[at] == want.argmax(-1)[at]).float().mean()
    return f"{kl.item():.5f} | {agree.item():.4f}"


def main() -> None:
    torch.set_num_threads(1)
    rt = open_runtime(None, use_guide=False)
    model = unfused(rt.loaded.model)
    x = canvas(rt)
    per_layer(model, x)
    n = len(model.blocks())
    kept = {
        "nothing (W8A8 everywhere)": lambda name: False,
        "the output head": lambda name: name == "lm_head",
        "every down_proj": lambda name: name.endswith("down_proj"),
        **{
            f"block {i}'s down_proj": (lambda name, i=i: name == f"model.layers.{i}.mlp.down_proj")
            for i in range(n)
        },
    }
    print("\n| kept in float32 | KL(float32 \\|\\| int8) | argmax agreement |\n|---|---|---|")
    for what, keep in kept.items():
        print(f"| {what} | {logits_error(model, x, rt.loaded.special.mask, keep)} |", flush=True)


if __name__ == "__main__":
    main()
