"""Objectives that extend from outside: a package's entry point in `klstudy.objectives` registers choices
that every registry reader then sees (trainer.objective.plugins). The package is the one
docs/guides/own_objective.md shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GUIDE = REPO / "docs" / "guides" / "own_objective.md"
PLUGIN = GUIDE.read_text().split("```python\n", 1)[1].split("```", 1)[0]  # the guide's package, my_objectives.py

CHECK = '''
from trainer.objective import estimators, plugins
from trainer.objective.objective_config import ObjectiveConfig

print(plugins.load(), plugins.load())
print("k1x2" in estimators.sampled_estimators())
print(ObjectiveConfig(estimator="k1x2", placement="loss", kl_loss_ratio="half", loss_agg="batch-sum").loss_agg)
'''


def _install(tmp_path: Path, module: str, body: str, target: str) -> dict[str, str]:
    """A package `module` whose entry point `target` is in klstudy.objectives, on a PYTHONPATH of its own."""
    (tmp_path / f"{module}.py").write_text(body)
    info = tmp_path / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[klstudy.objectives]\n{module} = {target}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


def test_a_plugins_choices_are_registered_before_any_registry_is_read(tmp_path):
    env = _install(tmp_path, "my_objectives", PLUGIN, "my_objectives")
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["('my_objectives',) ('my_objectives',)", "True", "batch-sum"]


def test_a_plugin_that_fails_to_load_is_one_clear_error(tmp_path):
    env = _install(tmp_path, "broken_objectives", "raise ImportError('no such thing')\n", "broken_objectives")
    done = subprocess.run([sys.executable, "-m", "trainer", "audit", "--presets", "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: klstudy.objectives entry point broken_objectives (broken_objectives): "
                                   "ImportError: no such thing")
