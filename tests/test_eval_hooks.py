"""Evaluation without lm-eval runs: the scoring hooks on hand-computed fixtures, the prompts and verifier
shared with training, the suites. tests/test_eval.py runs lm-eval on the toy model."""

import pytest

from eval.suites import SUITES, TASKS, SuiteError, expand
from eval.tasks import hooks


def test_math_hook_scores_each_sample_and_takes_gold_from_answer_or_solution():
    doc = {"problem": "Half of one?", "answer": "\\frac{1}{2}"}
    assert hooks.math_results(doc, ["so \\boxed{0.5}", "\\boxed{2}", "the answer is 1/2", "none"]) == {
        "pass_at_1": 0.5, "pass_at_k": 1.0}  # 2 of 4 right, by hand
    assert hooks.math_gold({"problem": "p", "solution": "thus $\\boxed{12}$."}) == "12"
    assert hooks.math_results({"problem": "p", "solution": "$\\boxed{12}$"}, ["\\boxed{13}"]) == {
        "pass_at_1": 0.0, "pass_at_k": 0.0}
    assert hooks.math_text(doc).startswith("Half of one?\nPlease reason step by step")


def test_choice_hook_reads_index_or_letter_gold():
    doc = {"question": "Unit of force?", "choices": ["joule", "newton", "watt", "pascal"], "answer": 1}
    assert hooks.choice_gold(doc) == "B" and hooks.choice_gold({**doc, "answer": "c"}) == "C"
    assert hooks.choice_results(doc, ["I think \\boxed{B}", "The answer is (A)", "(B)"]) == {
        "pass_at_1": 2 / 3, "pass_at_k": 1.0}
    assert "(B) newton" in hooks.choice_text(doc)


def test_hooks_take_the_k_samples_however_lm_eval_nests_them():
    doc = {"question": "8-6=", "answer": "2"}
    flat = hooks.arith_results(doc, ["2", "3"])
    assert hooks.arith_results(doc, [["2", "3"]]) == flat == {"pass_at_1": 0.5, "pass_at_k": 1.0}


def test_countdown_and_arith_hooks():
    doc = {"nums": [7, 3, 5], "target": 22}
    assert hooks.countdown_text(doc) == "3 5 7 make 22:"
    assert hooks.countdown_results(doc, ["3*5+7", "3+5+7"]) == {"pass_at_1": 0.5, "pass_at_k": 1.0}
    assert hooks.arith_text({"question": "8-6"}) == hooks.arith_text({"question": "8-6="}) == "8-6="
    assert hooks.arith_results({"question": "8-6=", "answer": "2"}, ["2", "3", "2", "-2"]) == {
        "pass_at_1": 0.5, "pass_at_k": 1.0}
    assert hooks.arith_natural_text({"question": "8-6="}) == "What is 8 - 6? Put your final answer within \\boxed{}."
    assert hooks.countdown_natural_text(doc) == ("Using the numbers 3, 5 and 7, each exactly once, and any of +, -, * "
                                                 "and /, write an expression that equals 22. Put the expression "
                                                 "within \\boxed{}.")


def test_training_and_evaluation_share_prompts_and_verifier():
    from trainer.tasks import make_task

    arithmetic, countdown = make_task("arithmetic"), make_task("countdown")
    p, c = arithmetic.problem(3), countdown.problem(3)
    assert hooks.arith_text({"question": p.question}) == p.question
    assert hooks.countdown_text({"numbers": c.meta["numbers"], "target": c.meta["target"]}) == c.question
    for style, arith_text, countdown_text in (("toy", hooks.arith_text, hooks.countdown_text),
                                              ("natural", hooks.arith_natural_text, hooks.countdown_natural_text)):
        p = make_task("arithmetic", {"prompt": style, "terms": 3}).problem(3)
        c = make_task("countdown", {"prompt": style}).problem(3)
        exported = {"question": p.meta["expression"] + "=", "answer": p.answer}  # python -m trainer export-data
        assert arith_text(exported) == p.question
        assert countdown_text({"nums": c.meta["numbers"], "target": c.meta["target"]}) == c.question
    assert hooks.countdown_results({"numbers": c.meta["numbers"], "target": c.meta["target"]}, [c.answer]) == {
        "pass_at_1": 1.0, "pass_at_k": 1.0}


def test_suites_are_defined_once_and_expand():
    assert expand(["in_domain"]) == ["math500", "math2"]
    assert expand(["all", "math500", "arith"]) == [*SUITES["all"], "arith"]
    assert set(SUITES["all"]) <= set(TASKS)
    with pytest.raises(SuiteError, match="'gsm8k' is neither a suite"):
        expand(["gsm8k"])
