"""A calculator tool for GSM8K with multi-turn GRPO (``train.grpo.tools: [data/tools/calculator.py:calculate]``).

Arithmetic only: numbers, ``+ - * / // % **`` and parentheses, evaluated by walking Python's syntax tree (no
``eval``: nothing the model writes can run code). Written by this project.
"""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponents above 64 are not computed")
        return _OPS[type(node.op)](left, right)
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
