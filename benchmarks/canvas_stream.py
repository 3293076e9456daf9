"""What the canvas stream costs: tok/s of streamed chat answers with include_canvas on vs off.

    OMP_NUM_THREADS=1 python benchmarks/canvas_stream.py --rounds 9
    OMP_NUM_THREADS=1 python benchmarks/canvas_stream.py --rounds 9 --no-guide --gen-length 256
    OMP_NUM_THREADS=1 python benchmarks/canvas_stream.py --no-guide --set unmask=fixed \
        --set steps=256 --set early_stop=false      # 256 steps: a frame per token

A real server on a loopback port (the shipped model, or --profile), one client reading the SSE
stream to its end. Each round sends the same question twice, once with and once without
`stream_options.include_canvas`, the order alternating between rounds so that a loaded machine
hurts both alike; tok/s is answer tokens over the client's wall time. Prints the median tok/s
of each, the median of the per-round ratios (on / off) and the canvas bytes per answer.

`--engine` instead times the server's own share without HTTP: an engine decoding the question
alone, each step's StepEvent built and its frame made and JSON-encoded (what the stepping
thread does for a watching request), against the same decode without; the frames' seconds are
summed separately, so that number does not depend on how loaded the machine is between runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from dllm_cli.decoding import open_engine
from dllm_cli.runtime import open_runtime
from dllm_cli.serve import canvas, server
from dllm_cli.serve.conversation import Message, encode_messages
from dllm_cli.serve.protocol import parse

QUESTION = "Tom has 3 apples and buys 2 more. How many apples does he have?"


def answer(url: str, body: dict) -> tuple[float, int]:
    """One streamed answer: (tok/s over the client's wall time, bytes of canvas chunks)."""
    began, size, usage = time.perf_counter(), 0, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            size += len(line) if "canvas" in chunk else 0
            usage = chunk.get("usage") or usage
    seconds = time.perf_counter() - began
    return usage["completion_tokens"] / seconds, size


def setting(item: str) -> tuple[str, object]:
    key, _, text = item.partition("=")
    try:
        return key, json.loads(text)
    except ValueError:
        return key, text


def engine_run(runtime, body: dict, frames: bool) -> tuple[float, float]:
    """One decode on an engine of its own: (wall seconds, seconds spent on frames)."""
    job = parse(body, "chat", runtime.settings, runtime.profile.name, runtime.guide is not None)
    committer = runtime.committer() if job.guide else None
    loaded = runtime.loaded
    engine = open_engine(loaded.model, loaded.special, job.settings, committer, slots=1)
    ids = encode_messages(loaded.tokenizer, [Message("user", QUESTION)])
    rid, stream = engine.add(ids), canvas.frames_for(runtime, job)
    began, spent = time.perf_counter(), 0.0
    while engine.has_work:
        out = engine.step()
        if frames:
            at = time.perf_counter()
            if out.event is not None:
                json.dumps(stream.frame(out.event, rid, 0, 0))
            spent += time.perf_counter() - at
    return time.perf_counter() - began, spent


def engine_share(runtime, body: dict, rounds: int) -> None:
    """--engine: the stepping thread's cost of frames, alternating with and without."""
    body = {**body, "stream_options": {"include_canvas": True}}
    walls: dict[bool, list[float]] = {True: [], False: []}
    spent = []
    for r in range(rounds):
        for frames in (True, False) if r % 2 == 0 else (False, True):
            wall, cost = engine_run(runtime, body, frames)
            walls[frames].append(wall)
            spent += [cost / wall] if frames else []
    off, on = statistics.median(walls[False]), statistics.median(walls[True])
    print(f"engine alone: median {off:.3f} s, with frames {on:.3f} s (ratio {off / on:.3f})")
    print(f"frames' share of a decode with them: median {100 * statistics.median(spent):.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--gen-length", type=int, default=None)
    parser.add_argument("--guide", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--engine", action="store_true", help="the stepping thread's share only")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a decoding setting for every request (a JSON value, else a string)",
    )  # fmt: skip
    args = parser.parse_args()
    given = {} if args.gen_length is None else {"decode.gen_length": args.gen_length}
    runtime = open_runtime(args.profile, given)
    body = {"messages": [{"role": "user", "content": QUESTION}], "stream": True}
    body["guide"] = args.guide and runtime.guide is not None
    body |= dict(setting(item) for item in args.set)
    print(f"profile {runtime.profile.name}, gen_length {runtime.settings.gen_length}, "
          f"guide {body['guide']}, {' '.join(args.set)}, {args.rounds} rounds")  # fmt: skip
    share = engine_share if args.engine else http_share
    share(runtime, body, args.rounds)


def http_share(runtime, body: dict, rounds: int) -> None:
    """The whole cost over HTTP: streamed answers with and without canvas chunks."""
    on = {**body, "stream_options": {"include_canvas": True}}
    handle = server.start_in_thread(runtime, server.Options(port=0, slots=1))
    try:
        answer(handle.url, on)  # warm up (first forwards, tokenizer caches)
        rates: dict[bool, list[float]] = {True: [], False: []}
        ratios, sizes = [], []
        for r in range(rounds):
            got = {}
            for with_canvas in (True, False) if r % 2 == 0 else (False, True):
                got[with_canvas], size = answer(handle.url, on if with_canvas else body)
                rates[with_canvas].append(got[with_canvas])
                sizes += [size] if with_canvas else []
            ratios.append(got[True] / got[False])
    finally:
        handle.stop()
    print(f"canvas off: median {statistics.median(rates[False]):.1f} tok/s")
    print(f"canvas on:  median {statistics.median(rates[True]):.1f} tok/s")
    print(f"on / off:   median ratio {statistics.median(ratios):.3f} "
          f"(rounds {min(ratios):.3f} .. {max(ratios):.3f})")  # fmt: skip
    print(f"canvas bytes per answer: {statistics.median(sizes):.0f}")


if __name__ == "__main__":
    main()
