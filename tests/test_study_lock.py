"""Who holds a study directory's lock: a dead holder's lock is released, a possibly live one refused."""

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sweep.study import study_lock

UNLOCK = ["snakemake", "--snakefile", "/abs/Snakefile", "--directory", "/abs/dir", "--unlock"]


def _record(directory, **fields):
    path = directory / study_lock.RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": socket.gethostname(), "started": "2026-11-23 06:00:00", **fields}))
    return path


def test_a_holder_that_is_alive_here_or_elsewhere_is_refused_with_the_unlock_command(tmp_path):
    live = _record(tmp_path, pid=os.getpid(), start_time=study_lock._start_time(os.getpid()))
    with pytest.raises(study_lock.StudyLocked, match=f"pid {os.getpid()} .*: it is still running.* "
                                                     "release the lock with: snakemake --snakefile /abs/Snakefile"):
        study_lock.check(["snakemake", "--profile", "p"], UNLOCK, tmp_path)
    assert study_lock.check(["snakemake", "--profile", "p", "-n"], UNLOCK, tmp_path) is None  # a dry run locks nothing
    assert live.exists()
    _record(tmp_path, pid=1, host="login-node-7")
    with pytest.raises(study_lock.StudyLocked, match="on login-node-7.*processes cannot be checked from"):
        study_lock.check(["snakemake"], UNLOCK, tmp_path)


def test_a_recycled_pid_is_not_the_holder(tmp_path):
    """The record's pid now belongs to another process (this one, started at another time)."""
    record = _record(tmp_path, pid=os.getpid(), start_time="1")
    unlock = [sys.executable, "-c", "print('unlocked')"]
    assert "is no longer running" in study_lock.check(["snakemake"], unlock, tmp_path)
    assert not record.exists()


def test_claim_and_release_write_and_remove_this_processs_record(tmp_path):
    study_lock.claim(["snakemake", "--profile", "p"], tmp_path)
    record = json.loads((tmp_path / study_lock.RECORD).read_text())
    assert record["pid"] == os.getpid() and record["argv"] == ["snakemake", "--profile", "p"]
    study_lock.release(tmp_path)
    assert not (tmp_path / study_lock.RECORD).exists()


def test_a_failed_unlock_is_one_clear_error(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _record(tmp_path, pid=int(dead.stdout), start_time=None)
    unlock = [sys.executable, "-c", "import sys; sys.exit('the metadata database is read-only')"]
    with pytest.raises(study_lock.StudyLocked, match="could not be released: the metadata database is read-only"):
        study_lock.check(["snakemake"], unlock, tmp_path)


def test_the_release_and_the_fetch_command_give_every_config_file_after_one_flag(tmp_path):
    """Snakemake keeps only the last of repeated --configfile flags: a study grown by an override file is both files
    after one flag, or its nested --unlock reads the override alone ('study: required')."""
    from sweep.hub import fetch

    base, grown = tmp_path / "study.yaml", tmp_path / "grown.yaml"
    unlock = study_lock.unlock_command(tmp_path / "Snakefile", tmp_path, [base, grown])
    assert unlock[unlock.index("--configfile"):] == ["--configfile", str(base), str(grown), "--unlock"]
    assert unlock.count("--configfile") == 1
    assert fetch.command([base, grown]) == f"python -m sweep fetch --configfile {base} {grown}"
    assert fetch.command(None) == "python -m sweep fetch --configfile STUDY.yaml"


def test_klstudys_commands_read_a_list_of_config_files_in_either_form(tmp_path):
    """`--configfile A B` and `--configfile A --configfile B` are both the study A grown by B."""
    from sweep.__main__ import main

    base, grown = tmp_path / "study.yaml", tmp_path / "grown.yaml"
    study = yaml.safe_load((Path(__file__).parents[1] / "workflow" / "config" / "toy_quick.yaml").read_text())
    base.write_text(yaml.safe_dump({**study, "results": str(tmp_path / "results")}))
    grown.write_text(yaml.safe_dump({"grid": {"seeds": [0, 1]}}))
    outputs = []
    for argv in (["--configfile", str(base), str(grown)], ["--configfile", str(base), "--configfile", str(grown)]):
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["status", *argv, "--json"]) == 0
        outputs.append(json.loads(printed.getvalue()))
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8  # 3 configurations and the baseline, 2 seeds
