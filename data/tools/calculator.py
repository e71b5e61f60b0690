"""A calculator tool for GSM8K with multi-turn GRPO (``train.grpo.tools: [data/tools/calculator.py:calculate]``).

Arithmetic only: numbers, ``+ - * / // % **`` and parentheses, evaluated by walking Python's syntax tree (no
``eval``: nothing the model writes can run code). Safe by construction: every operand and result is a real number
of at most :data:`MAX_BITS` bits (a power's size is bounded before it is computed), so each operation is a few
machine words' work and no expression of 200 characters can run long. Written by this project.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_BITS = 1024
"""The size of an integer the calculator computes at most (about 308 digits); larger is refused before it is
computed."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bits(x: float) -> float:
    """Binary digits of ``x``'s integer part (0 for ``|x| <= 1``)."""
    return x.bit_length() if isinstance(x, int) else (math.log2(abs(x)) if abs(x) > 1 else 0.0)


def _checked(value):
    if isinstance(value, complex) or not isinstance(value, (int, float)):
        raise ValueError("the result is not a real number")
    if _bits(value) > MAX_BITS:
        raise ValueError(f"the result is larger than 2**{MAX_BITS}")
    return value


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 64:
                raise ValueError("exponents above 64 are not computed")
            if _bits(left) * abs(right) > MAX_BITS:  # bounded before it is computed
                raise ValueError(f"the result is larger than 2**{MAX_BITS}")
        return _checked(_OPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.dump(node)[:40]}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression, with numbers, + - * / // % ** and parentheses, e.g. "(48 / 2) + 48".
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    value = _value(ast.parse(expression.replace(",", ""), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
