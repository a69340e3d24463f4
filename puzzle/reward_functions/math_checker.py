"""Math answer checking: extract the final answer of a response and compare it with the ground
truth. ``\\boxed{...}`` (the last one) or ``#### answer`` (GSM8K) answers; equality through the
``math-verify`` package when it is installed (``pip install math-verify``), else through a
normalised string match, a numeric match and a ``sympy`` difference that simplifies to 0.
"""

from __future__ import annotations

import re
from typing import Optional

_HASHES = re.compile(r"####\s*([^\n]+)")


def _boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a solution: the last ``\\boxed{}``, else what follows the last ``####``."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    found = _HASHES.findall(text)
    return found[-1].strip() if found else None


def normalize(ans: str) -> str:
    """Whitespace, ``$``, ``\\left``/``\\right``, ``\\!``, ``\\dfrac``, thousands commas and a
    trailing period removed or unified."""
    s = ans.strip().strip("$").strip()
    for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                 ("\\,", ""), ("\\ ", ""), ("^{\\circ}", ""), ("^\\circ", "")):
        s = s.replace(a, b)
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(\D|$))", "", s)
    s = s.rstrip(".").replace(" ", "")
    return s


def _to_sympy_text(s: str) -> str:
    for _ in range(4):  # nested fractions
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    for a, b in (("\\cdot", "*"), ("\\times", "*"), ("\\pi", "pi"), ("^", "**"), ("{", "("), ("}", ")")):
        s = s.replace(a, b)
    return s


def _sympy_equal(a: str, b: str) -> bool:
    try:
        import sympy
        from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                                standard_transformations)

        tr = standard_transformations + (implicit_multiplication_application,)
        x = parse_expr(_to_sympy_text(a), transformations=tr, evaluate=True)
        y = parse_expr(_to_sympy_text(b), transformations=tr, evaluate=True)
        return bool(sympy.simplify(x - y) == 0)
    except Exception:
        return False


def _math_verify_equal(pred: str, truth: str) -> Optional[bool]:
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:  # timeouts off: math-verify's own use SIGALRM, which only works in the main thread
        gold = parse("$" + truth + "$", parsing_timeout=None)
        guess = parse("$" + pred + "$", parsing_timeout=None)
        return bool(verify(gold, guess, timeout_seconds=None))
    except Exception:
        return None


def answers_equal(pred: str, truth: str) -> bool:
    """Whether two final answers are mathematically the same (see the module docstring)."""
    p, t = normalize(pred), normalize(truth)
    if not p or not t:
        return False
    if p == t:
        return True
    try:
        return abs(float(p) - float(t)) <= 1e-6 * max(1.0, abs(float(t)))
    except ValueError:
        pass
    mv = _math_verify_equal(p, t)
    if mv is not None:
        return mv
    return _sympy_equal(p, t)
