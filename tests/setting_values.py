"""One test value per DecodeSettings field: valid alone on the defaults, never the default.

Adding a setting is its field in settings.py and one value here; the flag, lifetime and server
tests are parametrised from this table and the declarations, and fail for a field without one.
"""

from __future__ import annotations

VALUES: dict[str, object] = {
    "gen_length": 12,
    "block_length": 4,
    "steps": 8,
    "cache": "prefix",
    "refresh_interval": 3,
    "suffix_window": 24,
    "unmask": "factor",
    "schedule": "dream",
    "confidence": "margin",
    "threshold": 0.5,
    "factor": 2.5,
    "eb_gamma": 0.3,
    "kl_threshold": 0.02,
    "kl_history": 3,
    "wino_verify": 0.95,
    "jump_threshold": 0.99,
    "credit_alpha": 1.5,
    "credit_boost": 0.5,
    "credit_decay": 0.9,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 5,
    "cfg_scale": 0.5,
    "seed": 7,
    "early_stop": True,
    "batching": "static",
    "eps": 0.01,
    "alg_temp": 0.5,
    "t_min": 0.3,
    "t_max": 0.9,
    "entropy_bound": 0.2,
    "stability_threshold": 2,
    "confidence_threshold": 0.01,
    "edit_threshold": 0.5,
    "max_post_steps": 3,
}
