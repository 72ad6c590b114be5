"""eval.lean_transformers: a process that imports the trainer or the evaluation loads transformers' models without
scikit-learn, can still import scikit-learn itself, and one that imported scikit-learn first gets
transformers' generation module as transformers wrote it. Each case in a fresh interpreter, since the
point is what a process imports."""

import pytest
from run_helpers import fresh_python_prints


@pytest.mark.parametrize("package", ["trainer", "eval"])
def test_a_model_class_loads_without_scikit_learn_which_stays_importable(package):
    assert fresh_python_prints(f"""
        import inspect, sys
        import {package}
        from transformers import LlamaForCausalLM
        import transformers.generation.candidate_generator as generator
        print("sklearn" in sys.modules, hasattr(generator, "roc_curve"), bool(inspect.getsource(generator)))
        from sklearn.metrics import roc_curve
        print(roc_curve.__module__.startswith("sklearn"))
    """) == ["False", "False", "True", "True"]


def test_a_process_that_imported_scikit_learn_first_loads_transformers_unchanged():
    assert fresh_python_prints("""
        import sklearn, trainer
        import transformers.generation.candidate_generator as generator
        print(hasattr(generator, "roc_curve"))
    """) == ["True"]
