"""--tensor-parallel 2 (torchrun, CPU gloo) with classifier-free guidance, the AR guide and a
JSON schema, on the shipped pair: the records one process writes; the guide and the grammar
cost the collectives the docs count (none for the guide, one small gather per masked token);
so do `--unmask eb` and `klass` (their entropy and KL in the drafts' one gather), and klass
beside a grammar."""

from __future__ import annotations

import json
import re

import pytest
from cli_fixtures import invoke, isolated_fixture  # noqa: F401
from test_tensor_parallel import launch

QUESTIONS = [
    "Question: Sam has 3 apples and buys 4 more. How many apples does Sam have now?",
    "Question: Mia has 10 cards and gives 2 to Tom. How many cards does Mia have now?",
    "Question: Tom has 5 pens. He loses 1. How many pens does he have now?",
]
OP = {
    "type": "object",
    "properties": {"op": {"enum": ["+", "-", "*", "/"]}, "ok": {"type": "boolean"}},
    "required": ["op", "ok"],
    "additionalProperties": False,
}
CASES = {  # three prompts through two slots: the third joins a running decode
    "cfg": ["-p", "tiny-gsm", "--cfg-scale", "1.5", "--cache", "prefix"],
    "guide": ["--cache", "dual", "--gen-length", "48"],  # the default profile's guide
    "schema": ["--top-k", "3"],  # (Dream's top-k filtered distribution), --json-schema below
    # sampled rows: the grammar reads the tempered, filtered distribution, noise drawn alike
    "sampled schema": ["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9"],
    "eb": ["-p", "tiny-gsm", "--unmask", "eb", "--eb-gamma", "0.3"],
    # Dream's filtered distribution: its KL from the gathered candidates; beside a grammar,
    # whose frontier window moves between steps (KLASS's shards follow its columns)
    "sampled klass schema": [
        *("--unmask", "klass", "--threshold", "0.3", "--kl-threshold", "0.5"),
        *("--temperature", "0.8", "--top-k", "5"),
    ],
}
SCHEMAS = ("schema", "sampled schema", "sampled klass schema")
MEASURED = ("eb",)
STATS = re.compile(r"(\d+) forwards, (\d+) all-reduces, (\d+) all-gathers")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_write_the_one_process_records(case, tmp_path):
    args = ["-", "--device", "cpu", "--gen-length", "24", "--json", "--batch-size", "2"]
    args += CASES[case]
    if case in SCHEMAS:
        (tmp_path / "op.json").write_text(json.dumps(OP))
        args += ["--json-schema", str(tmp_path / "op.json")]
    text = "".join(f"{q}\n" for q in QUESTIONS)
    expected = invoke("generate", *args, input=text)
    assert expected.exit_code == 0, expected.output
    result = launch(
        ["-m", "dllm_cli", "generate", *args, "--tensor-parallel", "2", "--stats"], text
    )
    assert result.returncode == 0, result.stderr[-3000:]
    fields = ("line", "text", "token_ids", "forwards", "guide_forwards", "steps")
    records = [{k: json.loads(line)[k] for k in fields} for line in result.stdout.splitlines()]
    assert records == [
        {k: json.loads(line)[k] for k in fields} for line in expected.stdout.splitlines()
    ]
    forwards, reduces, gathers = map(int, STATS.search(result.stderr).groups())
    assert reduces == forwards * (2 * 6 + 1)  # 6 layers: CFG's branches share each forward
    if case == "guide":
        assert sum(r["guide_forwards"] for r in records) > 0
        assert gathers == forwards  # the replicated guide adds no collective
    if case in MEASURED:
        assert gathers == forwards  # the entropy, the KL: numbers in the drafts' gather
    if case in SCHEMAS:
        assert all(set(json.loads(r["text"])) == {"op", "ok"} for r in records)
        assert gathers > forwards  # a masked token was chosen from the shards
