"""The README stays short and its set-up commands are the ones CI runs; every link in the docs
and every document the code cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += sorted((ROOT / "recipes").glob("*/README.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
CITED = re.compile(r"(?<![\w/])((?:docs|recipes|scripts|tests)/[\w/.-]+\.(?:md|py|jsonl))")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_is_short_and_opens_with_what_dllm_is():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 12 * 1024
    first = text.split("\n\n")[1]
    assert first.startswith("**dllm** is")


def test_ci_runs_the_readme_development_commands():
    """The second set-up block, its lines joined by `&&`, is the line `.ci/run` runs."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    install, develop = (" && ".join(b.strip().splitlines()) for b in blocks[:2])
    assert "pip install torch==2.13.0 ." in install and ".venv/bin/dllm generate" in install
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci == develop


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s) and other schemes
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.name}: no heading #{anchor} in {path}"


def test_every_document_the_code_cites_exists():
    sources = [*ROOT.glob("dllm_cli/**/*.py"), *ROOT.glob("tests/*.py")]
    sources += [*ROOT.glob("recipes/**/*.py"), *ROOT.glob("scripts/*.py")]
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for name in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", text):  # README.md, CHANGELOG.md
            assert (ROOT / name).exists(), f"{source.relative_to(ROOT)} cites {name}"
        for cited in CITED.findall(text):
            assert (ROOT / cited).exists(), f"{source.relative_to(ROOT)} cites {cited}"


LONG_PAGES = {"cli.md", "benchmarks.md"}  # generated from --help; every measurement
UNCHECKED_YET: set[str] = set()  # every guide is checked
GUIDES = [
    p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in LONG_PAGES | UNCHECKED_YET
]


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_every_guide_reads_in_one_sitting(page):
    """A guide past 15,000 bytes has become a lab notebook: split it, move its measurements to
    benchmarks.md and its screening notes to the CHANGELOG."""
    size = len(page.read_bytes())
    assert size <= 15_000, f"docs/{page.name} is {size} bytes (at most 15,000)"
