"""`dllm serve`: the model loaded once behind OpenAI's and Ollama's HTTP APIs (docs/serving.md).

Only Typer and the option table are imported here; the server (FastAPI, uvicorn, torch) is
imported when the command runs, so `dllm --help` stays fast.
"""

from __future__ import annotations

from typing import Annotated

from dllm_cli import options as o
from dllm_cli.commands.split import ExpertParallel, option

TensorParallel = Annotated[int, option("rank 0 serves HTTP, every rank steps every request")]

SERVER = "Server"
server = o.in_panel(SERVER)

Host = Annotated[str, server("Address to listen on (127.0.0.1: this machine only).")]
Port = Annotated[int, server("Port to listen on (0: any free port).")]
ApiKey = Annotated[
    str | None,
    server(
        "Require `Authorization: Bearer KEY` on every route but /health.",
        "--api-key",
        envvar="DLLM_API_KEY",
        show_default=False,
    ),
]
MaxQueue = Annotated[int, server("Requests that may wait for a slot; more get 429.")]
MaxEngines = Annotated[
    int,
    server(
        "Engines alive at once: requests with different decoding settings (max_tokens, "
        "cache, ...) need one each."
    ),
]
ScoreSamples = Annotated[
    int | None,
    server(
        "Monte-Carlo samples per likelihood estimate of echo scoring when a request gives "
        "no score_samples (default: the family reference's, 128).",
        show_default=False,
    ),
]
ScoreSplits = Annotated[
    int | None,
    server(
        "Echo scoring estimates only the last N context/continuation splits of a prompt "
        "(earlier positions get null logprobs) when a request gives no score_splits "
        "(default: every split; docs/scoring.md).",
        show_default=False,
    ),
]
AbortOnExit = Annotated[
    bool,
    server(
        "On SIGINT/SIGTERM abort the requests in flight (503) instead of finishing them.",
        "--abort-on-exit/--finish-on-exit",
    ),
]
Ui = Annotated[
    bool,
    server(
        "Serve the chat page at / that draws each answer's canvas as it decodes "
        "(docs/web.md); --no-ui: 404 there.",
        "--ui/--no-ui",
    ),
]


@o.shared("model", "decode", "guide")
def serve_command(
    *,
    choices: o.Choices,
    host: Host = "127.0.0.1",
    port: Port = 8000,
    api_key: ApiKey = None,
    batch_size: o.BatchSize = 8,
    max_queue: MaxQueue = 64,
    max_engines: MaxEngines = 4,
    abort_on_exit: AbortOnExit = False,
    score_samples: ScoreSamples = None,
    score_splits: ScoreSplits = None,
    ui: Ui = True,
    tensor_parallel: TensorParallel = 1,
    expert_parallel: ExpertParallel = False,
) -> None:
    """Serve the model over HTTP: POST /v1/chat/completions and /v1/completions (OpenAI's API), POST /api/generate, /api/chat and /api/show, GET /api/tags, /api/ps, /api/version (Ollama's), GET /v1/models, /health and /metrics, and a chat page at / that draws each answer's canvas live.

    Decoding flags set the server's defaults; a request may change them with extra body fields of the same names (gen_length, cache, threshold, ...). SIGINT or SIGTERM stops accepting requests, finishes those in flight (or aborts them with --abort-on-exit) and exits 0.
    """
    from dllm_cli.commands.common import USAGE, cli_errors, fail, note
    from dllm_cli.commands.split import leads, split_runtime

    with cli_errors():
        at_least = [("--batch-size", batch_size, 1), ("--max-queue", max_queue, 0)]
        at_least += [("--max-engines", max_engines, 1), ("--score-splits", score_splits, 1)]
        for name, value, low in at_least:
            if value is not None and value < low:
                raise fail(f"{name} must be at least {low} (got {value})", USAGE)
        if score_samples is not None and not 1 <= score_samples <= 4096:
            raise fail(f"--score-samples must be in 1..4096 (got {score_samples})", USAGE)
        if not 0 <= port <= 65535:
            raise fail(f"--port must be in 0..65535 (got {port})", USAGE)
        if api_key is not None and not api_key.strip():
            raise fail("--api-key is empty", USAGE)
        from dllm_cli.serve import server

        options = server.Options(
            host, port, api_key, batch_size, max_queue, max_engines, abort_on_exit,
            score_samples=score_samples, score_splits=score_splits, ui=ui,
        )  # fmt: skip
        with split_runtime(choices, tensor_parallel, expert_parallel, batch_size) as runtime:
            mirror = None
            if tensor_parallel > 1:
                from dllm_cli.serve.mirror import Channel, Leader, follow

                channel = Channel(runtime.loaded.model.shards)
                if not leads():  # another rank: rank 0's engines, step for step
                    return follow(runtime, batch_size, channel)
                mirror = Leader(channel)
            try:
                serving = f"serving {server.model_id(runtime)} on "
                server.run(runtime, options, ready=lambda url: note(serving + url), mirror=mirror)
            except OSError as e:  # the address is taken, or not this machine's
                raise fail(f"cannot listen on {host}:{port}: {e.strerror or e}", 1) from None
        note("server stopped")
