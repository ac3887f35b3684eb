"""`calculator`: an environment whose one tool evaluates arithmetic, and the arithmetic itself.

The expression is model output: it is parsed into a syntax tree (never evaluated as Python) and only
numbers, `+ - * / // % **` and parentheses are computed, exactly (fractions), with bounded sizes.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_CHARS = 200  # longer expressions are refused before parsing
MAX_MAGNITUDE = 10 ** 60  # any intermediate value beyond this is refused
MAX_EXPONENT = 64

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: Fraction(a // b), ast.Mod: lambda a, b: a % b}


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression, as text: `"12+30"` -> `"42"`, `"7/2"` -> `"3.5"`.

    Raises:
        ValueError: anything but numbers, + - * / // % ** and parentheses, a division by zero, or a value too
            large; the message says which (a tool's error goes back to the model).
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _value(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ValueError("division by zero")
            return _bounded(left ** int(right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(f"unsupported element in the expression: {type(node).__name__}")


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ValueError("a value in the expression is too large")
    return value


class Calculator:
    """An environment with one tool, `calculator`: every rollout gets its own, which counts its calls."""

    def __init__(self):
        self.calls = 0

    def reset(self, **row) -> None:
        """Called before each rollout with the dataset row; adds nothing to the prompt."""
        self.calls = 0
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "12+30".
        """
        self.calls += 1
        return evaluate(expression)
