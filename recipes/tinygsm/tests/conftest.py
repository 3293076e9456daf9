"""The recipe's tests import the checkout (the package and `recipes`), one thread each."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to the other processes

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
