"""A Hugging Face Hub on a loopback port for `dllm pull` tests: one repo, one commit, the hub's
URL layout (the model API for the file list, /{repo}/resolve/{revision}/{file} for the files,
with ETag, X-Repo-Commit and byte ranges). `drop` names a file whose first download is cut
off after `drop_at` bytes, the connection closed, as a flaky network does."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Hub:
    repo: str
    folder: Path
    drop: str | None = None
    drop_at: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range)
    tokens: set[str] = field(default_factory=set)  # the Authorization headers seen
    dropped: bool = False
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def files(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if p.is_file())

    def start(self) -> Hub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.log.append((h.command, path, h.headers.get("Range", "")))
        self.tokens.add(h.headers.get("Authorization", ""))
        if path.startswith("/api/models/") and not path.startswith(f"/api/models/{self.repo}/"):
            return self.send(
                h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}
            )
        if path.startswith(f"/api/models/{self.repo}/tree/"):
            return self.tree(h)
        if path.startswith(f"/api/models/{self.repo}/revision/"):
            return self.model_info(h)
        found = re.fullmatch(rf"/{re.escape(self.repo)}/resolve/([^/]+)/(.+)", path)
        if found is None or not (self.folder / found.group(2)).is_file():
            return self.send(h, 404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"})
        self.file(h, found.group(2), body)

    def model_info(self, h: BaseHTTPRequestHandler) -> None:
        info = {
            "id": self.repo,
            "modelId": self.repo,
            "sha": COMMIT,
            "private": False,
            "siblings": [{"rfilename": f} for f in self.files()],
        }
        self.send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"})

    def tree(self, h: BaseHTTPRequestHandler) -> None:
        """The file list as the tree API answers it (type, path, size, git blob id)."""
        items = []
        for name in self.files():
            data = (self.folder / name).read_bytes()
            oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            items.append({"type": "file", "path": name, "size": len(data), "oid": oid})
        self.send(h, 200, json.dumps(items).encode(), {"Content-Type": "application/json"})

    def file(self, h: BaseHTTPRequestHandler, name: str, body: bool) -> None:
        data = (self.folder / name).read_bytes()
        headers = {
            "X-Repo-Commit": COMMIT,
            "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        status = 200
        if ranged:
            start, status = int(ranged.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        if not body:
            headers["Content-Length"] = str(len(data))
            return self.send(h, 200, b"", headers, length=len(data))
        if name == self.drop and not self.dropped:  # drop_at bytes, then the line goes dead
            self.dropped = True
            h.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(part))}.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(part[: self.drop_at])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        self.send(h, status, part, headers)

    def send(
        self, h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict,
        length: int | None = None,
    ) -> None:  # fmt: skip
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(data) if length is None else length))
        h.end_headers()
        if data:
            h.wfile.write(data)
