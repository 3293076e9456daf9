"""Imports point one way: commands -> batch/distributed/view/bench -> runtime -> decoding -> models.

Read from the source (ast), so a new module must find its place in LAYERS, and an import that
reaches up a layer, a cycle, or typer below the command layer fails here, not in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dllm_cli"

# Lowest first. A module may import modules of its own layer or of lower ones.
LAYERS: list[tuple[str, ...]] = [
    (
        "errors",
        "settings",
        "setting_spec",  # what a setting declares beside its DecodeSettings field
        "cache",
        "strict_toml",
        "prompt_text",
        "problems",
        "tinygsm",
        "folders",
        "families",
        "family_settings",
        "lifetimes",
        "version",
        "omp",  # libgomp's spin default, set before torch loads
        "fit_sizes",  # config.json (and safetensors headers) -> each family's sizes
        "fit",  # sizes -> bytes; free memory
        "hub",  # models by name: huggingface_hub's cache
    ),  # version: __version__ for any layer; tinygsm: the built-in model's files (no code)
    ("models",),
    ("decoding", "scoring"),  # scoring: the likelihood estimators (models in, numbers out)
    ("profiles", "profile_sections", "profile_paths"),  # profile_paths: model folders, hub copies
    ("runtime", "chat"),
    (
        "batch",
        "distributed",
        "view",
        "text_stream",
        "view_words",
        "view_export",
        "bench",
        "bench_batching",
        "peer",  # bench --peer: llama.cpp beside dllm
        "frontier",
        "throughput",
        "doctor",
        "evaluate",
        "api",
        "serve",  # dllm serve / dllm chat: the server, the chat session, the load benchmark
    ),
    # entry points; "dllm_cli" (the package): __version__, and `LLM` loaded lazily from api
    ("dllm_cli", "options", "commands", "cli", "__main__"),
]
TYPER_ALLOWED = ("options", "commands", "cli")  # the command-line layer
PURE = {  # know nothing of models or decoding
    "distributed": ("distributed", "errors"),
    "view_words": (),  # words from a decode function, whatever the tokenizer
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts) or "dllm_cli"


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> tuple[set[str], set[str]]:
    """(our modules it imports, third-party top-level packages it imports)."""
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            targets = (
                [f"{base}.{a.name}" for a in node.names] if base.startswith("dllm_cli") else [base]
            )
        else:
            continue
        for target in targets:
            if target == "dllm_cli" or target.startswith("dllm_cli."):
                ours.add(resolve(target.removeprefix("dllm_cli").lstrip(".") or "dllm_cli"))
            else:
                theirs.add(target.split(".")[0])
    ours.discard(name)
    return ours, theirs


def resolve(dotted: str) -> str:
    """`decoding.answer.first_stop` -> `decoding.answer` (the longest prefix that is a module)."""
    while dotted not in MODULES and "." in dotted:
        dotted = dotted.rsplit(".", 1)[0]
    return dotted if dotted in MODULES else "dllm_cli"  # a name from dllm_cli/__init__.py


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int:
    found = [
        (len(prefix), i)
        for i, layer in enumerate(LAYERS)
        for prefix in layer
        if within(name, prefix)
    ]
    assert found, f"dllm_cli.{name} has no layer: add it to LAYERS in {Path(__file__).name}"
    return max(found)[1]


@pytest.mark.parametrize("name", list(MODULES))
def test_imports_never_reach_up_a_layer(name):
    ours, theirs = imports(name)
    for target in ours:
        assert layer_of(target) <= layer_of(name), f"{name} imports {target}, a higher layer"
    if "typer" in theirs:
        assert any(within(name, p) for p in TYPER_ALLOWED), f"{name} imports typer"
    for prefix, allowed in PURE.items():
        if within(name, prefix):
            stray = [t for t in ours if not any(within(t, a) for a in allowed)]
            assert not stray, f"{name} imports {stray}"


def test_nothing_installed_imports_the_recipe():
    """The training recipe (generators, tokenizer builder, phases) stays out of the package."""
    for name in MODULES:
        assert "recipes" not in imports(name)[1], f"{name} imports the recipe"


def test_no_import_cycles():
    graph = {name: imports(name)[0] for name in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            assert state.get(target) != 1, f"import cycle: {' -> '.join([*path, name, target])}"
            if target not in state:
                visit(target, [*path, name])
        state[name] = 2

    for name in MODULES:
        if name not in state:
            visit(name, [])


def test_no_module_over_400_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {name: n for name, n in sizes.items() if n > 400} == {}
