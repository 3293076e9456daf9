"""A real `dllm serve` process for tests: started, its URL read from its note on stderr."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def launch(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Run `args` (a `dllm serve --port 0 ...` command line) until it says where it serves."""
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for line in proc.stderr:
        found = re.search(r"serving \S+ on (http://\S+)", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining
            return proc, found.group(1)
    raise AssertionError(f"server did not start (exit {proc.wait()})")
