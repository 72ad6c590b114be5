"""How the project installs: a plain `pip install -e .` must let Snakemake find the executor plugin."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What Snakemake does to find executor plugins, in a python that sees only the stdlib and the
# installed editable wheel (-S: no site-packages, so not the venv's own install of klstudy).
FIND_PLUGIN = """
import pkgutil, site, sys
site.addsitedir(sys.argv[1])
print(sorted(m.name for m in pkgutil.iter_modules() if m.name.startswith("snakemake_executor_plugin_")))
"""


def test_a_plain_editable_install_makes_the_executor_plugin_visible_to_snakemake(tmp_path):
    """setuptools' default editable mode for a flat layout is a path hook that pkgutil.iter_modules()
    does not see; `snakemake --profile profiles/slurm` then failed with "invalid choice: 'submitit'"."""
    build = "import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))"
    built = subprocess.run([sys.executable, "-c", build, str(tmp_path / "wheel")], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = tmp_path / "wheel" / built.stdout.split()[-1]
    site_dir = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as archive:  # what pip does with a pure-Python wheel
        archive.extractall(site_dir)
    found = subprocess.run([sys.executable, "-S", "-c", FIND_PLUGIN, str(site_dir)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert "snakemake_executor_plugin_submitit" in found.stdout, (found.stdout, [p.name for p in site_dir.iterdir()])
