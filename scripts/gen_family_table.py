"""Write the feature x family table of docs/families.md from the family table (families.py).

    python scripts/gen_family_table.py           # rewrite the table in docs/families.md
    python scripts/gen_family_table.py --check   # exit 1 when it is stale

A cell is "yes" or "refused (N)", N numbering the family table's reason under the table.
tests/test_family_matrix.py checks the page against this and proves every cell on a tiny
folder of each family, so neither the page nor the refusals can drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dllm_cli.families import FAMILIES, Family  # noqa: E402
from dllm_cli.family_settings import refusal  # noqa: E402
from dllm_cli.settings import CACHES, UNMASKS  # noqa: E402

TARGET = ROOT / "docs" / "families.md"
BEGIN, END = "<!-- feature table: scripts/gen_family_table.py -->", "<!-- end of feature table -->"
EVERYWHERE = (
    "`generate` (text, `--json`)",
    "`chat` (the first answer is generate's)",
    "`visualize --save`",
    "`serve` (chat, stream, a refused setting is one request's 400)",
    "Python API (`LLM.generate`, `LLM.stream`)",
    "`eval --data`",
    "`profiles show --model` (the folder's own values)",
    "`bench`",
    "torchrun data parallel",
)
# Family.cannot keys -> their row (every key a family uses needs one: KeyError otherwise)
CANNOT = {
    "quantize": "`--quantize int8`",
    "logprobs": "answer logprobs (`--logprobs`, serve)",
    "grammar": "structured output (`--json-schema`, `--grammar`, `response_format`)",
    "scoring": "likelihood scoring (`LLM.score`, serve's echo scoring)",
    "lengths": "per-request gen_length in one engine (`--json-input` lines, serve's `max_tokens`)",
}


def cells(family: Family) -> list[tuple[str, str | None, bool]]:
    """(feature, why it is refused or None, refused?) for every row of the table."""
    out = [(name, None, False) for name in EVERYWHERE]
    batch = "stdin batch, static == continuous == alone"
    out.append((batch, family.static_batches, False))  # a note: why its batches are static
    for key, feature in CANNOT.items():
        why = family.cannot.get(key)
        out.append((feature, why, why is not None))
    for key, values in (("cache", CACHES), ("unmask", UNMASKS)):
        for value in values:
            why = refusal(family, key, value)
            out.append((f"`--{key} {value}`", why, why is not None))
    return out


def table() -> str:
    """The markdown between the markers: the table, then the numbered reasons."""
    families = list(FAMILIES.values())
    unknown = {key for f in families for key in f.cannot} - set(CANNOT)
    if unknown:
        raise KeyError(f"Family.cannot keys without a row in CANNOT: {sorted(unknown)}")
    columns = [cells(f) for f in families]
    reasons: dict[str, int] = {}

    def cell(why: str | None, refused: bool) -> str:
        if why is None:
            return "yes"
        number = reasons.setdefault(why, len(reasons) + 1)
        return f"refused ({number})" if refused else f"yes ({number})"

    lines = ["| feature | " + " | ".join(f.title for f in families) + " |"]
    lines.append("|---" * (len(families) + 1) + "|")
    for i, (feature, _, _) in enumerate(columns[0]):
        row = [cell(why, refused) for why, refused in ((c[i][1], c[i][2]) for c in columns)]
        lines.append(f"| {feature} | " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"{n}. {why}" for why, n in reasons.items()]
    return "\n".join(lines)


def render(page: str) -> str:
    """The page with its table block replaced by the current one."""
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    page = TARGET.read_text(encoding="utf-8")
    fresh = render(page)
    if "--check" in argv:
        if fresh != page:
            print(f"{TARGET} is stale: run python scripts/gen_family_table.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
