"""Where grpo_lab keeps what it builds: tiny models, runs, the local bucket.

`GRPO_LAB_HOME` overrides the default `~/.cache/grpo_lab`.
"""

from __future__ import annotations

import os
from pathlib import Path


def grpo_lab_home() -> Path:
    """The cache root, created on first use."""
    root = Path(os.environ.get("GRPO_LAB_HOME") or Path.home() / ".cache" / "grpo_lab")
    root.mkdir(parents=True, exist_ok=True)
    return root
