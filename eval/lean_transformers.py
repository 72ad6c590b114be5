"""transformers without scikit-learn at start-up.

transformers' generation module (`transformers.generation.candidate_generator`, which every causal LM
class loads) imports scikit-learn whenever it is installed, and with it SciPy's statistics, for one
function (`roc_curve`) of assisted decoding's adaptive threshold. klstudy never decodes with an
assistant model, and scikit-learn is here only as a dependency of MLflow and lm-eval, yet that import
cost about a second of CPU in every process that loads a model: a fifth of a short training run's
start. `install()` hides scikit-learn from that one module while it loads; an import of scikit-learn
anywhere else, before or after, is untouched, and a process that has already imported it loads the
module as transformers wrote it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

HIDDEN_FROM = "transformers.generation.candidate_generator"
HIDDEN = "sklearn"


class _LoadWithoutScikitLearn(importlib.abc.Loader):
    """The module's own loader, with scikit-learn reported missing while the module runs
    (`sys.modules[name] = None` is how Python marks a module that must not be imported)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        hide = HIDDEN not in sys.modules
        if hide:
            sys.modules[HIDDEN] = None
        try:
            self.loader.exec_module(module)
        finally:
            if hide and HIDDEN in sys.modules and sys.modules[HIDDEN] is None:
                del sys.modules[HIDDEN]

    def __getattr__(self, name):  # get_source, get_filename, ...: tracebacks read the module's source
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != HIDDEN_FROM or HIDDEN in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoadWithoutScikitLearn(spec.loader)
        return spec


def install() -> None:
    """Once per process, before transformers' generation module loads: eval/__init__.py, which the
    trainer's package imports first."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
