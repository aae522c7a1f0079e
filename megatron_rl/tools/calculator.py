"""The calculator tool: exact arithmetic on an expression, evaluated from its syntax tree (never `eval`).

Integers and decimals with + - * / // % ** and parentheses; division is exact (a fraction prints as a decimal
when it terminates within 12 places, else as p/q). Powers are bounded, so no expression runs away with the
rank's time or memory.
"""

from __future__ import annotations

import ast
import operator
from decimal import Decimal
from fractions import Fraction

from megatron_rl.tools.types import ToolResult

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                       "description": "e.g. 12*(3+4)"}},
                       "required": ["expression"]},
    },
}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 1000
MAX_LENGTH = 500


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(Decimal(str(node.value)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1:
                raise ValueError("only whole-number exponents are supported")
            if abs(right) > MAX_EXPONENT or (abs(left) > 1 and abs(right) * len(str(abs(left.numerator))) > 10_000):
                raise ValueError("the power is too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax: {ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__}")


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    decimal = Decimal(value.numerator) / Decimal(value.denominator)
    if Fraction(decimal.quantize(Decimal(10) ** -12)) == value:
        return format(decimal.normalize(), "f")
    return f"{value.numerator}/{value.denominator}"


def evaluate(expression: str) -> str:
    """The expression's exact value as text; ValueError naming what is wrong."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from None
    try:
        return format_number(_value(tree.body))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None


async def calculator(expression: str) -> ToolResult:
    try:
        return ToolResult(evaluate(expression))
    except ValueError as e:
        return ToolResult(f"error: {e}", is_error=True)
