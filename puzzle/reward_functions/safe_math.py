"""A whitelist parser for final answers: text in, sympy objects out, nothing evaluated as code.

sympy's ``parse_expr``/``sympify`` turn text into Python source and ``eval`` it, so a model's
response (or a data file's ``answer``) could run code through them. This parser reads only:

* numbers (``12``, ``3.5``, ``.5``; exact rationals), the letters ``a``-``z``/``A``-``Z`` as
  symbols, ``\\pi``;
* ``+ - * /``, ``\\cdot``, ``\\times``, ``\\div``, ``^`` (right-associative), implicit products
  (``2\\sqrt{2}``, ``3x``, ``2(1+1)``), parentheses, brackets and braces as groups;
* ``\\frac{a}{b}`` (also ``\\frac12``), ``\\sqrt{x}``, ``\\sqrt[n]{x}``, ``sqrt(x)``.

Anything else is a :class:`MathParseError`. The objects are built with sympy's constructors
(``Integer``, ``Rational``, ``Symbol``, ``Add``, ``Mul``, ``Pow``); powers whose numeric result
would exceed ``MAX_POWER_BITS`` are refused, as is text longer than ``MAX_LENGTH``, so a crafted
answer can neither run code nor exhaust memory here.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import List, Tuple

#: sympy, imported by the first parse: importing it costs ~2 s, which every reward worker process
#: would pay at start even when its reward function never parses an answer
sympy = None

MAX_LENGTH = 300
MAX_POWER_BITS = 100_000
_TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|(\\[a-zA-Z]+)|([a-zA-Z]+)|(\S))")
_MUL_OPS = {"*", "\\cdot", "\\times"}
_DIV_OPS = {"/", "\\div"}
_OPEN = {"(": ")", "[": "]", "{": "}"}


class MathParseError(ValueError):
    """Text outside the whitelist (see the module docstring)."""


def _tokens(text: str) -> List[Tuple[str, str]]:
    """(kind, text) pairs: num, cmd, word, op."""
    out = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise MathParseError(f"unexpected text at {pos}")
        num, cmd, word, op = m.groups()
        if num is not None:
            out.append(("num", num))
        elif cmd is not None:
            out.append(("cmd", cmd))
        elif word is not None:
            if word == "sqrt":
                out.append(("cmd", "\\sqrt"))
            else:
                out.extend(("word", ch) for ch in word)  # "xy": the product of x and y
        else:
            out.append(("op", op))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str):
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> Tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, expected: str = None) -> Tuple[str, str]:
        tok = self.peek()
        if tok[0] == "end" or (expected is not None and tok[1] != expected):
            raise MathParseError(f"expected {expected or 'more'} at token {self.i}, found {tok[1] or 'the end'}")
        self.i += 1
        return tok

    def parse(self):
        value = self.expr()
        if self.peek()[0] != "end":
            raise MathParseError(f"unexpected {self.peek()[1]!r} at token {self.i}")
        return value

    def expr(self):
        terms = [self.term()]
        while self.peek()[1] in ("+", "-"):
            sign = self.take()[1]
            t = self.term()
            terms.append(t if sign == "+" else sympy.Mul(sympy.Integer(-1), t))
        return sympy.Add(*terms)

    def _starts_atom(self) -> bool:
        kind, text = self.peek()
        return kind in ("num", "word") or text in _OPEN or text in ("\\frac", "\\sqrt", "\\pi")

    def term(self):
        value = self.unary()
        while True:
            text = self.peek()[1]
            if text in _MUL_OPS:
                self.take()
                value = sympy.Mul(value, self.unary())
            elif text in _DIV_OPS:
                self.take()
                value = sympy.Mul(value, _power(self.unary(), sympy.Integer(-1)))
            elif self._starts_atom():  # implicit product
                value = sympy.Mul(value, self.power())
            else:
                return value

    def unary(self):
        if self.peek()[1] in ("+", "-"):
            sign = self.take()[1]
            value = self.unary()
            return value if sign == "+" else sympy.Mul(sympy.Integer(-1), value)
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek()[1] == "^":
            self.take()
            return _power(base, self.unary() if self.peek()[1] in ("+", "-") else self.power())
        return base

    def group(self):
        """{...}, or one digit / letter / atom (``\\frac12``)."""
        kind, text = self.peek()
        if text == "{":
            return self.atom()
        if kind == "num" and len(text) > 1 and text.isdigit():  # \frac12: one digit per argument
            self.toks[self.i] = ("num", text[1:])
            return _number(text[0])
        return self.atom()

    def atom(self):
        kind, text = self.take()
        if kind == "num":
            return _number(text)
        if kind == "word":
            return sympy.Symbol(text)
        if text in _OPEN:
            value = self.expr()
            self.take(_OPEN[text])
            return value
        if text == "\\pi":
            return sympy.pi
        if text == "\\frac":
            num = self.group()
            return sympy.Mul(num, _power(self.group(), sympy.Integer(-1)))
        if text == "\\sqrt":
            index = sympy.Integer(2)
            if self.peek()[1] == "[":
                self.take()
                index = self.expr()
                self.take("]")
            radicand = self.group() if self.peek()[1] != "(" else self.atom()
            return _power(radicand, sympy.Integer(1) / index)
        raise MathParseError(f"{text!r} is not allowed in an answer")


def _number(text: str):
    f = Fraction(text)
    return sympy.Rational(f.numerator, f.denominator)


def _power(base, exponent):
    """base ** exponent, refused where a numeric result would be huge (e.g. ``9^{9^{9}}``)."""
    if exponent.is_Number and base.is_Number and not base.is_zero and abs(base) != 1:
        size = max(abs(base.p).bit_length() if base.is_Rational else 64,
                   abs(base.q).bit_length() if base.is_Rational else 64, 1)
        if abs(float(exponent)) * size > MAX_POWER_BITS:
            raise MathParseError("a power too large to compare")
    elif exponent.is_Number and abs(float(exponent)) > MAX_POWER_BITS:
        raise MathParseError("a power too large to compare")
    return sympy.Pow(base, exponent)


def parse_math(text: str):
    """The sympy object ``text`` denotes (see the module docstring); MathParseError otherwise."""
    if len(text) > MAX_LENGTH:
        raise MathParseError(f"longer than {MAX_LENGTH} characters")
    _import_sympy()
    return _Parser(text).parse()


def _import_sympy() -> None:
    global sympy
    if sympy is None:
        import sympy as module

        sympy = module


def math_equal(a: str, b: str, rel_tol: float = 1e-9) -> bool:
    """Whether two answers denote the same value: parsed by :func:`parse_math`, then a numeric
    comparison when both are numbers, else ``simplify(a - b) == 0``; False when either does not
    parse."""
    try:
        x, y = parse_math(a), parse_math(b)
    except (MathParseError, ZeroDivisionError, ValueError, TypeError, RecursionError):
        return False
    try:
        if not x.free_symbols and not y.free_symbols:
            xv, yv = complex(sympy.N(x, 30)), complex(sympy.N(y, 30))
            return all(math.isfinite(v) for v in (xv.real, xv.imag, yv.real, yv.imag)) and \
                abs(xv - yv) <= rel_tol * max(1.0, abs(yv))
        return bool(sympy.simplify(x - y) == 0)
    except Exception:  # sympy's own errors on odd input (e.g. a comparison it cannot decide)
        return False
