"""How the report draws the objective's choices, keyed by name: an estimator's colour and marker, a
placement's marker fill.

The trainer's registries say what a choice computes; how a figure draws it is the report's own. A name
this table does not know (a plugin's) still gets a style of its own: picked from spare ones by a hash of
the name, so that it is the same in every figure and every report.
"""

from __future__ import annotations

import zlib

ESTIMATORS = {"k1": ("tab:blue", "o"), "k2": ("tab:orange", "s"), "k3": ("tab:green", "^"),
              "k3+": ("tab:olive", "v"), "full": ("tab:red", "D")}  # (colour, marker)
SPARE_ESTIMATORS = (("tab:purple", "P"), ("tab:brown", "h"), ("tab:pink", "<"), ("tab:cyan", ">"))
PLACEMENT_FILLS = {"reward": "full", "loss": "none", "reward+loss": "left", "reward-to-go": "bottom",
                   "reward-to-go+loss": "right", "reward-token": "top", "reward-centred": "full"}
DEFAULT_FILL = "full"


def _estimator(name: str) -> tuple[str, str]:
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    return SPARE_ESTIMATORS[zlib.crc32(str(name).encode()) % len(SPARE_ESTIMATORS)]


def estimator_color(name: str) -> str:
    return _estimator(name)[0]


def estimator_marker(name: str) -> str:
    return _estimator(name)[1]


def placement_fill(name: str) -> str:
    return PLACEMENT_FILLS.get(name, DEFAULT_FILL)
