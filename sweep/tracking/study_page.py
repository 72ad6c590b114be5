"""What a researcher sees of a study in MLflow's UI: its landing page, as saved views of the runs page.

MLflow 3.17's UI, measured in a browser (docs/mlflow_ui.md), shows none of the study on its own:
the experiment opens in the GenAI mode whatever the experiment's kind tag says (the mode is the
URL's `workflowType`, else the browser's last choice), and the runs page nests the grid points
under one collapsed parent row unless it is sorted by something other than the start time. A saved
view (an experiment tag `mlflow.sharedViewState.<id>` that the "Views" menu lists and the link
`?viewStateShareKey=<id>` opens) holds the rest: the filter to the grid points, the sort by run
name (which orders by model, configuration, beta, extra axes, seed), and the columns that matter,
coordinates first. A second view groups the seeds of a grid point and averages them.

A grid point's own page gets a description that says which of its charts answer the study's question.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from sweep.runs import RunRecord
from sweep.tracking.concurrent_tags import set_experiment_tag

VIEW_PREFIX = "mlflow.sharedViewState."  # MLflow's own prefix: the UI lists these in its "Views" menu
GRID_POINTS = "tags.`klstudy.role` = 'grid-point'"  # the runs sweep.tracking.experiment tags as grid points
GRID_VIEW, MEAN_VIEW = "klstudy-grid-points", "klstudy-mean-over-seeds"
VIEW_NAMES = {GRID_VIEW: "klstudy: every grid point", MEAN_VIEW: "klstudy: mean over seeds"}
SORT_BY_NAME = "tags.`mlflow.runName`"  # any sort but the start time lists the grid points, not their parent
TAG_POINT = "klstudy.point"  # the grid point without its seed: what the mean-over-seeds view groups by
NOTE = "mlflow.note.content"  # a run's description in the UI
OBJECTIVE = ("objective/gap", "objective/kl", "objective/reward")  # at the measured steps (sweep.tracking.experiment)
WIDTHS = {"tags": 90, "metrics": 125}  # px: at 1600 px the coordinates and the first metrics fit side by side


def runs_page(base: str, experiment_id: str) -> str:
    """The study's landing page: the saved view of every grid point, in the UI's training mode."""
    return (f"{base}/#/experiments/{experiment_id}/runs?viewStateShareKey={GRID_VIEW}"
            "&workflowType=machine_learning")


def point_of(record: RunRecord) -> str:
    """`toy__k1-loss__b0.1__async2` for `toy__k1-loss__b0.1__async2__s0`: the run id without its seed."""
    return re.sub(rf"__s{record.coords.get('seed')}$", "", record.run_id)


def description(record: RunRecord) -> str:
    """A grid point's description: where it sits in the grid, and which charts hold the study's numbers."""
    coords = ", ".join(f"{axis} {value}" for axis, value in record.coords.items()
                       if axis not in ("estimator", "placement") and value is not None)
    return (f"**{record.label}**, {coords}: grid point `{record.run_id}`.\n\n"
            "The study's numbers: `eval/<suite>/<task>/pass_at_1` (pass@1 of each evaluated checkpoint; the "
            "final model's at the last step), `objective/gap` (J* - J(pi) at this run's beta, lower is better), "
            "`objective/kl` (KL to the reference) and `objective/reward` (held-out reward), measured on held-out "
            "prompts. Training curves: `reward_mean`, `kl_*`, `entropy` (section \"Model metrics\").\n")


def grid_point_tags(record: RunRecord) -> dict[str, str]:
    """A grid point's grouping tag and description: tags of its child run, logged with its others
    (sweep.tracking.run_sync), so they cost no request of their own."""
    return {TAG_POINT: point_of(record), NOTE: description(record)}


def columns_of(record: RunRecord) -> list[str]:
    """The runs-page columns a grid point fills: its coordinates (configuration, model, beta, the extra
    axes, seed as klstudy.* tags), pass@1 per evaluated task, the measured objective, the training reward."""
    tags = ["config_label", *(axis for axis in record.coords if axis not in ("estimator", "placement"))]
    metrics = [f"eval/{e.suite}/{task}/pass_at_1" for e in record.evaluations() for task in e.scores.get("tasks", {})]
    measured = record.objective[-1] if record.objective else {}
    metrics += [name for name in OBJECTIVE if name.split("/")[1] in measured]
    return [f"tags.`klstudy.{t}`" for t in tags] + [f"metrics.`{m}`" for m in [*metrics, "reward_mean"]]


def _order(column: str) -> tuple:
    """Coordinates first (configuration, model, beta, extra axes, seed), then tasks, objective, reward."""
    kind, name = column.split(".", 1)
    name = name.strip("`")
    if kind == "tags":
        rank = {"klstudy.config_label": 0, "klstudy.model": 1, "klstudy.beta": 2, "klstudy.seed": 9}
        return (0, rank.get(name, 5), name)
    return (1, 0 if name.startswith("eval/") else 1 if name in OBJECTIVE else 2, OBJECTIVE.index(name)
            if name in OBJECTIVE else 0, name)


def view_state(columns: list[str], group: bool) -> dict[str, Any]:
    """The runs page's state as MLflow's UI saves it: search facets, then UI state."""
    state: dict[str, Any] = {"searchFilter": GRID_POINTS, "orderByKey": SORT_BY_NAME, "orderByAsc": True,
                             "selectedColumns": columns, "columnOrder": columns,
                             "columnWidths": {c: WIDTHS[c.split(".")[0]] for c in columns}}
    if group:
        state["groupBy"] = {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": TAG_POINT}]}
    return state


def _saved_state(tags: dict[str, str], key: str) -> tuple[dict[str, Any], int | None]:
    """(state, createdAt) of a saved view among the experiment's tags; ({}, None) if absent or unreadable."""
    try:
        envelope = json.loads(tags[VIEW_PREFIX + key])
        return json.loads(envelope["state"]), envelope["createdAt"]
    except (KeyError, TypeError, ValueError):
        return {}, None


def publish_views(client, experiment_id: str, records: list[RunRecord]) -> None:
    """The study's saved views, with the columns of `records` added to those already there (a follower
    syncs its own runs only); each written only when it changes. One read per sync."""
    tags = client.get_experiment(experiment_id).tags
    now = int(time.time() * 1000)
    for key, group in ((GRID_VIEW, False), (MEAN_VIEW, True)):
        old, created = _saved_state(tags, key)
        found = set(old.get("selectedColumns", [])) | {c for r in records for c in columns_of(r)}
        state = view_state(sorted(found, key=_order), group)
        if state != old:
            envelope = {"name": VIEW_NAMES[key], "createdAt": created or now, "updatedAt": now,
                        "state": json.dumps(state)}
            set_experiment_tag(client, experiment_id, VIEW_PREFIX + key, json.dumps(envelope))

