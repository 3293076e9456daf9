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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from dllm_cli.runtime import open_runtime
from dllm_cli.serve import server

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--gen-length", type=int, default=None)
    parser.add_argument("--guide", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a decoding setting for every request (a JSON value, else a string)",
    )  # fmt: skip
    args = parser.parse_args()
    given = {} if args.gen_length is None else {"decode.gen_length": args.gen_length}
    runtime = open_runtime(args.profile, given)
    handle = server.start_in_thread(runtime, server.Options(port=0, slots=1))
    body = {"messages": [{"role": "user", "content": QUESTION}], "stream": True}
    body["guide"] = args.guide and runtime.guide is not None
    body |= dict(setting(item) for item in args.set)
    on = {**body, "stream_options": {"include_canvas": True}}
    try:
        answer(handle.url, on)  # warm up (first forwards, tokenizer caches)
        rates: dict[bool, list[float]] = {True: [], False: []}
        ratios, sizes = [], []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {}
            for canvas in order:
                got[canvas], size = answer(handle.url, on if canvas else body)
                rates[canvas].append(got[canvas])
                sizes += [size] if canvas else []
            ratios.append(got[True] / got[False])
    finally:
        handle.stop()
    print(f"profile {runtime.profile.name}, gen_length {runtime.settings.gen_length}, "
          f"guide {body['guide']}, {' '.join(args.set)}, {args.rounds} rounds")  # fmt: skip
    print(f"canvas off: median {statistics.median(rates[False]):.1f} tok/s")
    print(f"canvas on:  median {statistics.median(rates[True]):.1f} tok/s")
    print(f"on / off:   median ratio {statistics.median(ratios):.3f} "
          f"(rounds {min(ratios):.3f} .. {max(ratios):.3f})")  # fmt: skip
    print(f"canvas bytes per answer: {statistics.median(sizes):.0f}")


if __name__ == "__main__":
    main()
