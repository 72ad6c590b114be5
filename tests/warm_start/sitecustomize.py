"""Imported by Python at start-up when tests/warm_start is on PYTHONPATH (tests/conftest.py puts it there):
hands a `python -m trainer|eval|sweep` process to a warm worker (klstudy_warm_start). A test's own sitecustomize
later on the path still runs, before the hand-off."""

import os
import sys


def _next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(entry) if entry else "" for entry in sys.path]
    for entry in entries[entries.index(here) + 1:] if here in entries else []:
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            with open(path) as source:
                exec(compile(source.read(), path, "exec"), {"__name__": "sitecustomize", "__file__": path})
            return


_next_sitecustomize()
if os.environ.get("KLSTUDY_WARM_DIR"):
    import klstudy_warm_start

    klstudy_warm_start.hand_off()
