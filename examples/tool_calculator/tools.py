"""The example's tool registry (``--tools-path examples.tool_calculator.tools.TOOLS``): one calculator.

The expression is parsed with ``ast`` and only integer literals, ``+``, ``-``, ``*``, unary minus and
parentheses are evaluated; anything else (names, calls, attributes, ``/``, ``**``) is refused with a message the
model sees as the tool's response. Nothing the model writes is ever executed as code.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200
# Products of long operands grow fast; a result this long is no longer arithmetic the task asks for.
MAX_RESULT_DIGITS = 40

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}
_UNARY: dict[type[ast.unaryop], Callable[[int], int]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: refused
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if len(str(abs(value))) > MAX_RESULT_DIGITS:
            raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported syntax '{ast.unparse(node)}': use integers, + - * and parentheses")


def evaluate(expression: str) -> int:
    """The value of an integer expression with + - * and parentheses; ValueError for anything else."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse '{expression}': {e.msg}") from None
    return _evaluate(tree.body)


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression with + - * and parentheses, e.g. "123 * 45"."""
    return str(evaluate(expression))


TOOLS = {"calculator": calculator}
