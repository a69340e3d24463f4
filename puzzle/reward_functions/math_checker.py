"""Math answer checking: extract the final answer of a response and compare it with the ground
truth. ``\\boxed{...}`` (the last one) or ``#### answer`` (GSM8K) answers; equality through a
normalised string match, a numeric match, then the ``math-verify`` package when it is installed
(``pip install math-verify``; its LaTeX parser only), else the whitelist parser of ``safe_math``.

Nothing here evaluates text as code: responses and data files are untrusted. sympy's
``parse_expr``/``sympify`` (which call ``eval``) are never used, nor math-verify's plain-expression
extraction (which uses ``parse_expr``); latex2sympy2's LaTeX conversion builds sympy objects from
its own grammar.
"""

from __future__ import annotations

import math
import re
from typing import Optional

from puzzle.reward_functions.safe_math import math_equal

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


def _math_verify_equal(pred: str, truth: str) -> Optional[bool]:
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        return None
    latex_only = [LatexExtractionConfig()]  # its ExprExtractionConfig path calls sympy's parse_expr
    try:  # timeouts off: math-verify's own use SIGALRM; the caller's per-sample timeout bounds the call
        gold = parse("$" + truth + "$", extraction_config=latex_only, parsing_timeout=None)
        guess = parse("$" + pred + "$", extraction_config=latex_only, parsing_timeout=None)
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
        x, y = float(p), float(t)
        return math.isfinite(x) and math.isfinite(y) and abs(x - y) <= 1e-6 * max(1.0, abs(y))
    except ValueError:
        pass
    mv = _math_verify_equal(p, t)
    if mv is not None:
        return mv
    return math_equal(p, t)
