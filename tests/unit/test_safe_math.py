"""The math checker parses answers without eval: whitelist parser cases, and crafted responses
and ground truths that must neither run nor crash (nor exhaust memory)."""

import pytest

from puzzle.reward_functions.builtin import math_answer
from puzzle.reward_functions.math_checker import answers_equal
from puzzle.reward_functions.safe_math import MathParseError, math_equal, parse_math


@pytest.mark.parametrize("text, value", [
    ("\\frac{1}{2}", "1/2"), ("\\frac12", "1/2"), ("2\\sqrt{2}", "2*sqrt(2)"), ("\\sqrt[3]{27}", "3"),
    ("3x+2", "3*x + 2"), ("2(1+1)", "4"), ("2^{10}", "1024"), ("2^2^3", "256"), ("10^{-3}", "1/1000"),
    ("-\\frac{3}{4}", "-3/4"), ("\\pi r^2", "pi*r**2"), ("sqrt(2)", "sqrt(2)"), ("1/2+1/3", "5/6"),
    ("2\\cdot 3\\times 4 \\div 8", "3"), ("[1+2]", "3"), (".5", "1/2")])
def test_whitelist_parses(text, value):
    assert str(parse_math(text)) == value


def test_equality():
    assert math_equal("x^2-1", "(x-1)(x+1)") and math_equal("\\frac{2}{4}", "0.5")
    assert not math_equal("3", "4") and not math_equal("\\frac{1}{0}", "1") and not math_equal("x", "y")
    assert answers_equal("2\\sqrt{2}", "\\sqrt{8}") and answers_equal("\\sqrt[3]{27}", "3")
    assert not answers_equal("1" * 400, "1" * 401)  # both overflow a float: not equal


MALICIOUS = [
    "__import__('os').system('touch {marker}')",
    "exec(\"open('{marker}', 'w')\")",
    "eval('1')", "x.__class__.__bases__", "lambda: 1", "Symbol('x')", "\\input{{/etc/passwd}}",
    "9^{{9^{{9^{{9}}}}}}", "(" * 400 + "1" + ")" * 400, "1" * 10000, "((2))^{{99999999}}", "{{",
]


@pytest.mark.parametrize("template", MALICIOUS, ids=range(len(MALICIOUS)))
def test_crafted_answers_do_not_run_and_do_not_crash(template, tmp_path):
    marker = tmp_path / "created"
    text = template.format(marker=marker)
    with pytest.raises(MathParseError):
        parse_math(text)
    assert not answers_equal(text, "1") and not answers_equal("1", text)
    # the whole reward: a response and a ground truth carrying it score 0, no exception
    assert math_answer(["p", "p"], [f"\\boxed{{{text}}}", "#### 1"], [{"answer": "1"}, {"answer": text}]) == [0.0, 0.0]
    assert not marker.exists()


def test_no_eval_or_exec_while_comparing(monkeypatch):
    import builtins

    pairs = [("x^2-1", "(x-1)(x+1)"), ("\\frac{\\pi}{2}", "1.5707963267948966"), ("2^{10}", "1024"),
             ("\\sqrt[3]{27}", "3"), ("__import__('os')", "1")]
    expected = [answers_equal(a, b) for a, b in pairs]  # first: sympy's own lazy imports
    called = []
    monkeypatch.setattr(builtins, "eval", lambda *a, **k: called.append(a))
    monkeypatch.setattr(builtins, "exec", lambda *a, **k: called.append(a))
    assert [answers_equal(a, b) for a, b in pairs] == expected == [True, True, True, True, False]
    assert called == []
