"""What a notebook achieved, written where its runner reads it: `record_results(results_path, ...)`.

Every course notebook has a `results_path` parameter (None when a learner runs it by hand) and
ends by recording the values its asserts checked; the course's tests read them back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def record_results(results_path: str | os.PathLike | None, **values) -> dict:
    """Merge `values` into the JSON file at `results_path` (no-op when it is None)."""
    if results_path is None:
        return values
    path = Path(results_path)
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(values)
    path.write_text(json.dumps(current, indent=2, default=float))
    return current
