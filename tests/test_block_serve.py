"""`dllm serve` on the block-causal families: a setting the family refuses is one request's 400,
and the server goes on answering (it once built the engine first and then answered 500 for good).
"""

from __future__ import annotations

import httpx
import pytest
from block_checkpoints import write_llada2, write_sdar

from dllm_cli.runtime import open_runtime
from dllm_cli.serve import server

WRITERS = {"sdar": write_sdar, "llada2": write_llada2}
# (the family table's refusals: tests/test_family_matrix_serve.py, every family)
REFUSED = [({"unmask": "fixed", "threshold": 2.0}, "threshold must be in [0, 1] (got 2.0)")]


@pytest.fixture(scope="module", params=list(WRITERS))
def url(request, tmp_path_factory):
    folder = WRITERS[request.param](tmp_path_factory.mktemp(request.param) / "m").folder
    runtime = open_runtime(
        None, {"model.path": str(folder), "decode.gen_length": 8}, use_guide=False
    )
    handle = server.start_in_thread(runtime, server.Options(port=0, slots=2, max_queue=8))
    yield handle.url
    handle.stop()


def complete(url: str, **fields) -> httpx.Response:
    body = {"prompt": "how many apples", "max_tokens": 8, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("fields, words", REFUSED)
def test_a_refused_setting_is_a_400_and_the_server_goes_on(url, fields, words):
    refused = complete(url, **fields)
    assert refused.status_code == 400, refused.text
    assert words in refused.json()["error"]["message"]
    answered = complete(url)
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["text"] is not None


@pytest.mark.slow
def test_model_ids_have_no_spaces(url):
    ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    assert ids and all(" " not in i and i.endswith("-reference") for i in ids), ids
