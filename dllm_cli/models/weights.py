"""A folder's safetensors -> a model's parameters, by name, without transformers.

The model is built on the meta device (no memory, no random init); every tensor is read in its
stored dtype, cast, and assigned to the parameter of its name; tied parameters are tied again.
Names and shapes are checked first (`check_weights`), so a folder loads completely or not at
all, each failure one ModelLoadError line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from dllm_cli.errors import ModelLoadError

# The torch.nn.init functions torch's own layers call in their reset_parameters.
INIT_FUNCTIONS = ("uniform_", "normal_", "kaiming_uniform_", "zeros_", "ones_")


@contextmanager
def meta_skeleton() -> Iterator[None]:
    """Build modules on the meta device without running their random init: the init's
    meta-tensor path imports torch._dynamo (about 1 s at start-up), and a load replaces every
    value anyway (transformers skips it the same way, patching torch.nn.init)."""
    kept = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
    try:
        for name in INIT_FUNCTIONS:
            setattr(nn.init, name, _leave)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in kept.items():
            setattr(nn.init, name, fn)


def _leave(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def weight_files(folder: Path) -> list[Path]:
    """The safetensors shards of a folder (via the index when there is one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{index} is not valid JSON: {e}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ModelLoadError(f"{index} has no valid weight_map (tensor name -> shard file)")
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shard(s) named in the index are missing: {missing}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"no weights in {folder} (expected model.safetensors or an index + shards)"
    )


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one tensor (e.g. ["lm_head.weight", "model.embed_tokens.weight"])."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def check_weights(folder: Path, model: nn.Module) -> None:
    """Compare checkpoint tensor names and shapes with the model before loading anything."""
    from safetensors import safe_open

    found: dict[str, tuple[int, ...]] = {}
    for f in weight_files(folder):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found[name] = tuple(st.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises several types for a damaged file
            raise ModelLoadError(f"cannot read weights {f}: {e}") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    # a tied name may be absent when one of its group is stored (HF saves the tensor once)
    tied = {n for group in tied_groups(model) if any(g in found for g in group) for n in group}
    missing = [k for k in expected if k not in found and k not in tied]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{folder}: checkpoint is missing parameter {missing[0]}{more}")
    for name, shape in expected.items():
        if name in found and found[name] != shape:
            raise ModelLoadError(
                f"{folder}: parameter {name} has shape {list(found[name])} in the checkpoint, "
                f"but the config implies {list(shape)}"
            )


def read_weights(folder: Path, model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` (meta-built) holding the folder's tensors, floating ones cast to `dtype`, shard by
    shard; tensors it has no place for (e.g. stored rotary caches) are ignored, as transformers."""
    from safetensors import safe_open

    wanted = set(model.state_dict(keep_vars=True))
    groups = tied_groups(model)
    read: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name in wanted:
                    t = st.get_tensor(name)
                    read[name] = t.to(dtype) if t.is_floating_point() else t
        model.load_state_dict(read, strict=False, assign=True)
        read.clear()  # one shard's tensors held at a time
    for group in groups:  # the loaded member of each group, under every name of it
        retie(model, group)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ModelLoadError(f"{folder}: checkpoint is missing parameter {left[0]}")
    return model


def retie(model: nn.Module, names: list[str]) -> None:
    """Point every name of a tied group at the one tensor that was loaded."""
    params = [model.get_parameter(n) for n in names]
    loaded = next((p for p in params if not p.is_meta), None)
    if loaded is None:
        return
    for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, loaded)
