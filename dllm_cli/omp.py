"""OpenMP's idle threads spin briefly, then sleep: a CPU decode on a shared machine stays fast.

torch's CPU wheels run their intra-op threads (and MKL's) on GNU libgomp, whose idle threads
busy-wait 300,000 spins at every parallel region's end before sleeping when neither
OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set (libgomp manual, GOMP_SPINCOUNT). A forward is a few
hundred regions; when another process holds one of the cores, the thread that waits burns the
slice its partner needs, and a 2-thread forward at the peer's shape took 0.5-2.7 s instead of
0.1-0.2 s (docs/cpu.md). 1000 spins (libgomp's own ACTIVE value for oversubscribed CPUs) keeps
back-to-back regions hot and yields soon otherwise. libgomp reads its environment once, when
it loads, so this runs at the CLI's start, before torch is imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

SPIN = ("GOMP_SPINCOUNT", "1000")
CHOSEN = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # a user's own choice wins
added: dict[str, str] = {}  # what spin_briefly put into this process's environment


def spin_briefly(
    environ: MutableMapping[str, str] = os.environ, modules: Mapping[str, object] = sys.modules
) -> bool:
    """Set GOMP_SPINCOUNT=1000 unless a wait policy is chosen or torch is loaded already."""
    if any(name in environ for name in CHOSEN) or "torch" in modules:
        return False
    name, value = SPIN
    environ[name] = value
    added[name] = value
    return True


def user_environment() -> dict[str, str]:
    """This process's environment without what spin_briefly added (for another tool's run)."""
    return {k: v for k, v in os.environ.items() if added.get(k) != v}
