"""The README's first commands paste and run as a new user reads them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL)
DOC_BLOCKS = [  # the README's examples and the docs' (docs/usage.md, docs/benchmarks.md, ...)
    block
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.DOTALL)
]


def test_install_and_development_set_ups_are_separate_blocks():
    """Pasting the user's set-up must not also install the dev extras and run the suite."""
    for block in BLOCKS:
        assert not ("pip install torch==2.13.0 ." in block and '".[dev]"' in block), block
    assert any("pip install torch==2.13.0 ." in b for b in BLOCKS)
    assert any('".[dev]"' in b and "pytest" in b for b in BLOCKS)


def test_ci_runs_the_readmes_development_commands():
    """`.ci/run` runs the README's development block, joined by `&&`, so the two cannot drift."""
    (block,) = [b for b in BLOCKS if '".[dev]"' in b]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == " && ".join(block.strip().splitlines())


def test_readme_says_where_the_commands_live():
    head = README[: README.index("```bash", README.index("```bash") + 1)]
    assert "`.venv/bin/`" in head


def test_every_plot_example_names_the_plot_extra():
    """`--plot` fails without matplotlib, which only the [plot] extra installs."""
    plotting = [b for b in DOC_BLOCKS if "--plot" in b]
    assert plotting
    for block in plotting:
        assert "[plot]" in block, block
