"""Safe integer/boolean expressions for schedule files.

Schedule files are data, not code: their counts, step placements and conditions are small
expressions over a fixed set of names (``stages``, ``stage``, ``micro_batches``, ``mb`` and the
schedule's declared parameters). They are parsed with :mod:`ast` and evaluated by walking a
whitelist of node types, so nothing in a file can import, call arbitrary functions or touch
attributes.
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Mapping

ALLOWED_FUNCTIONS = {"min": min, "max": max, "abs": abs, "range": range, "len": len}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}

ALLOWED_SYNTAX = (
    "integers, True/False, names, + - * // %, comparisons, in / not in, "
    "and / or / not, `a if c else b`, [lists], and calls of " + ", ".join(sorted(ALLOWED_FUNCTIONS))
)


class ExpressionError(ValueError):
    """An expression in a schedule file that cannot be parsed or evaluated."""


class Expression:
    """A parsed expression; ``evaluate(env)`` computes it for one set of names."""

    def __init__(self, source: str | int | bool):
        if isinstance(source, bool) or isinstance(source, int):
            source = repr(source)
        if not isinstance(source, str):
            raise ExpressionError(f"expected an expression string or integer, got {source!r}")
        self.source = source.strip()
        try:
            tree = ast.parse(self.source, mode="eval")
        except SyntaxError as exc:
            raise ExpressionError(f"cannot parse expression {self.source!r}: {exc.msg}") from None
        self._check(tree.body)
        self._tree = tree.body
        self.names = frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name)) - set(ALLOWED_FUNCTIONS)

    def _check(self, node: ast.AST) -> None:
        ok = (
            (
                ast.Constant,
                ast.Name,
                ast.BinOp,
                ast.UnaryOp,
                ast.BoolOp,
                ast.Compare,
                ast.IfExp,
                ast.List,
                ast.Tuple,
                ast.Call,
                ast.Load,
                ast.And,
                ast.Or,
            )
            + tuple(_BINARY)
            + tuple(_UNARY)
            + tuple(_COMPARE)
        )
        for sub in ast.walk(node):
            if not isinstance(sub, ok):
                raise ExpressionError(
                    f"{type(sub).__name__} is not allowed in expression {self.source!r}; allowed: {ALLOWED_SYNTAX}"
                )
            if isinstance(sub, ast.Constant) and not isinstance(sub.value, (int, bool)):
                raise ExpressionError(f"constant {sub.value!r} in {self.source!r}: only integers and booleans")
            if isinstance(sub, ast.Call):
                if not isinstance(sub.func, ast.Name) or sub.func.id not in ALLOWED_FUNCTIONS or sub.keywords:
                    raise ExpressionError(
                        f"call in {self.source!r}: only {', '.join(sorted(ALLOWED_FUNCTIONS))} "
                        "with positional arguments"
                    )

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        return self._eval(self._tree, env)

    def _eval(self, node: ast.AST, env: Mapping[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise ExpressionError(f"unknown name {node.id!r} in {self.source!r}; known: {', '.join(sorted(env))}")
            return env[node.id]
        if isinstance(node, ast.BinOp):
            left, right = self._eval(node.left, env), self._eval(node.right, env)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ExpressionError(f"division by zero in {self.source!r}")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](self._eval(node.operand, env))
        if isinstance(node, ast.BoolOp):
            values = (self._eval(v, env) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, env)
            for op, comp in zip(node.ops, node.comparators):
                right = self._eval(comp, env)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return self._eval(node.body if self._eval(node.test, env) else node.orelse, env)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._eval(e, env) for e in node.elts]
        if isinstance(node, ast.Call):
            return ALLOWED_FUNCTIONS[node.func.id](*(self._eval(a, env) for a in node.args))
        raise ExpressionError(f"unsupported syntax in {self.source!r}")  # unreachable after _check

    def __repr__(self) -> str:
        return f"Expression({self.source!r})"
