"""The chat page at `/`: one static bundle (serve/web/) that watches each answer's canvas.

The page is a client of the API like any other: it posts the conversation to
/v1/chat/completions with `stream_options.include_canvas` and draws the frames (canvas.py).
Nothing is fetched from outside the server (no CDN, no web font). The server's decoding
settings are written into the page as JSON, so the settings panel shows what a request may
set and what it gets without setting it. The page and its assets need no API key (the page
asks for one when the server wants it); `--no-ui` leaves them out (404).
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from dllm_cli.serve.protocol import SETTINGS, ApiError
from dllm_cli.setting_spec import declared
from dllm_cli.settings import DecodeSettings

# file name -> media type: the only files served under /web/
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
CONFIG_MARK = "{{config}}"
# The choice list the panel offers per setting, as declared (empty: typed in; the server
# validates either).
CHOICES = {name: spec.choices for name, spec in declared(DecodeSettings)}


def is_page(path: str, ui: bool) -> bool:
    """The page and its assets: served without the API key (the page asks for it)."""
    return ui and (path == "/" or path.removeprefix("/web/") in ASSETS)


@cache
def bundled(name: str) -> str:
    return resources.files("dllm_cli.serve.web").joinpath(name).read_text(encoding="utf-8")


def add_routes(app: FastAPI, served) -> None:
    """GET / and /web/<asset>, unless the server runs with --no-ui."""
    if not served.ui:
        return

    @app.get("/", response_class=HTMLResponse)
    async def index():
        config = json.dumps(page_config(served)).replace("<", "\\u003c")  # safe in a <script>
        return HTMLResponse(bundled("index.html").replace(CONFIG_MARK, config), headers=NO_STORE)

    @app.get("/web/{name}")
    async def asset(name: str):
        if name not in ASSETS:
            raise ApiError(404, f"no such file: /web/{name}")
        return Response(bundled(name), media_type=ASSETS[name], headers=NO_STORE)


NO_STORE = {"Cache-Control": "no-cache"}


def page_config(served) -> dict:
    """What the page shows and may send: the model, its settings and whether a key is needed."""
    runtime = served.worker.runtime
    settings: DecodeSettings = runtime.settings
    types = {f.name: str(f.type) for f in dataclasses.fields(DecodeSettings)}
    rows = [
        dict(name=n, type=types[n], value=getattr(settings, n), choices=list(CHOICES.get(n, ())))
        for n in SETTINGS
    ]
    return {
        "model": served.model_id,
        "settings": rows,
        "guide": runtime.guide is not None,
        "key": served.api_key is not None,
    }
