"""uvicorn around the app: bind, say where, stop gracefully on SIGINT/SIGTERM, exit 0.

On the first SIGINT or SIGTERM the server stops accepting connections and new requests (503),
lets the requests in flight finish (or, with `abort_on_exit`, aborts them: each gets a 503
error object) and returns normally, so the command exits 0. uvicorn re-raises the signal it
caught once it is done; that is what made a clean stop exit 130, so it is not re-raised here.
A second SIGINT stops at once, as uvicorn does.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn

from dllm_cli.models.collectives import RankLost
from dllm_cli.runtime import Runtime
from dllm_cli.serve.app import create_app
from dllm_cli.serve.metrics import Metrics
from dllm_cli.serve.plumbing import Served
from dllm_cli.serve.worker import Worker

if TYPE_CHECKING:
    from dllm_cli.serve.mirror import Leader


@dataclass(frozen=True)
class Options:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    slots: int = 8
    max_queue: int = 64
    max_engines: int = 4
    abort_on_exit: bool = False
    log_level: str = "warning"
    score_samples: int | None = None  # echo scoring's default sample count (None: the family's)
    score_splits: int | None = None  # echo scoring: positions scored from the end (None: all)
    ui: bool = True  # the chat page at / (--no-ui: off)


class Server(uvicorn.Server):
    """uvicorn's server, telling the worker to stop with it."""

    def __init__(self, config: uvicorn.Config, worker: Worker, abort: bool):
        super().__init__(config)
        self.worker, self.abort = worker, abort

    def handle_exit(self, sig, frame) -> None:
        self.worker.stop(abort=self.abort)
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a clean stop is not an interruption: exit 0


def model_id(runtime: Runtime) -> str:
    """The name clients give as `model`: the served profile's."""
    return runtime.profile.name


def build(runtime: Runtime, options: Options) -> tuple[Served, Worker]:
    metrics = Metrics(model_id(runtime))
    worker = Worker(runtime, options.slots, options.max_engines, metrics)
    served = Served(
        model_id(runtime), worker, metrics, limit=options.slots + options.max_queue,
        api_key=options.api_key, created=int(time.time()), score_samples=options.score_samples,
        score_splits=options.score_splits, ui=options.ui,
    )  # fmt: skip
    return served, worker


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: a free one), bound before uvicorn starts so that the
    address can be announced and a bind failure reported as one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def prepare(runtime: Runtime, options: Options, **config) -> tuple[Server, socket.socket, str]:
    """The worker's app under uvicorn, its listening socket and the address it serves."""
    served, worker = build(runtime, options)
    sock = bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    app = create_app(served)
    config = uvicorn.Config(app, log_level=options.log_level, access_log=False, **config)
    shown = f"[{host}]" if ":" in host else host
    return Server(config, worker, options.abort_on_exit), sock, f"http://{shown}:{port}"


def run(
    runtime: Runtime,
    options: Options,
    ready: Callable[[str], None] | None = None,
    mirror: Leader | None = None,
) -> None:
    """Serve until a signal; `ready(url)` is called once the socket listens. `mirror`: the
    other ranks of --tensor-parallel follow the worker's engines; losing one ends the server
    (its RankLost raised here once the server stopped)."""
    server, sock, url = prepare(runtime, options, timeout_graceful_shutdown=None, lifespan="off")
    worker = server.worker
    worker.mirror = mirror
    worker.ended = lambda: setattr(server, "should_exit", True)
    worker.start()
    if ready is not None:
        ready(url)
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop(abort=True)
        worker.close()
        sock.close()
    if isinstance(worker.failure, RankLost):
        raise worker.failure


@dataclass
class Running:
    """A server on a thread of this process (tests, `dllm bench --serve`)."""

    url: str
    server: Server
    thread: threading.Thread
    worker: Worker

    def stop(self) -> None:
        self.worker.stop(abort=True)
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.worker.close()


def start_in_thread(runtime: Runtime, options: Options) -> Running:
    """Serve on a background thread (no signal handling there); returns once it listens."""
    server, sock, url = prepare(runtime, options, lifespan="off")
    server.worker.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    return Running(url, server, thread, server.worker)
