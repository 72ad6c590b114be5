"""The files a run directory holds, and their one reader: the trainer writes them, sweep reads them.

Kept free of torch so that the study level can import it cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
COMPLETE = "COMPLETE"
OBJECTIVE = "objective.jsonl"                     # the regularized objective measured at some steps
OBJECTIVE_REFERENCE = "objective_reference.json"  # the reference's reward histogram per held-out prompt


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl (or objective.jsonl) lines, in order; a torn last line (a run killed mid-write) is dropped."""
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return lines
