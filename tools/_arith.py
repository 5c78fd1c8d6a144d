"""Safe arithmetic by walking Python's ``ast``; no ``eval``. Stdlib only.

Only numbers, ``+ - * / // % **``, unary signs, the constants ``pi``, ``e`` and
``tau``, and a short list of math functions are allowed. Sizes are checked as
the walk goes (the expression length, the nesting depth, the bit size of
integer results, exponents and factorials), which gives good error messages.
These checks cannot bound every builtin (``round(1, -10**7)`` builds a
ten-million-digit power of ten), so ``agentrl.tools.calculator`` runs
``evaluate`` in a worker process under a deadline: this file is also that
worker's script (one JSON request per stdin line, one JSON reply per stdout
line). Call ``agentrl.tools.calculator.evaluate``, not this one.
"""

import ast
import json
import math
import operator
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["FUNCTION_NAMES", "CalcError", "evaluate", "format_number", "serve"]

MAX_EXPR_CHARS = 1_000
MAX_DEPTH = 50
MAX_INT_BITS = 4_096  # about 1,233 decimal digits
MAX_FACTORIAL = 400

_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalcError(ValueError):
    """The expression is not allowed or cannot be computed; the message says why."""


def _factorial(n: float) -> int:
    if n != int(n) or n < 0:
        raise CalcError("factorial needs a non-negative whole number")
    if n > MAX_FACTORIAL:
        raise CalcError(f"factorial is limited to n <= {MAX_FACTORIAL}")
    return math.factorial(int(n))


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "floor": math.floor,
    "ceil": math.ceil,
    "factorial": _factorial,
    "gcd": math.gcd,
}
FUNCTION_NAMES = tuple(_FUNCTIONS)


def _check_size(value: Any) -> Any:
    if isinstance(value, complex):
        raise CalcError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalcError(f"an intermediate result exceeds {MAX_INT_BITS} bits")
    return value


def _power(base: Any, exp: Any) -> Any:
    if isinstance(base, int) and isinstance(exp, int) and abs(base) > 1:
        if abs(exp) > MAX_INT_BITS:
            raise CalcError(f"the exponent {exp} is too large (limit {MAX_INT_BITS})")
        if exp > 0 and exp * math.log2(abs(base)) > MAX_INT_BITS:
            raise CalcError(f"{base}**{exp} would exceed {MAX_INT_BITS} bits")
    elif isinstance(exp, int) and abs(exp) > 10**6:
        raise CalcError("the exponent is too large")
    return base**exp


def _binop(op: ast.operator, left: Any, right: Any) -> Any:
    """``left op right``, size-checked."""
    if isinstance(op, ast.Pow):
        return _check_size(_power(left, right))
    if isinstance(op, ast.BitXor):
        raise CalcError("'^' is not a power here; write ** for powers (2**10)")
    fn = _BINOPS.get(type(op))
    if fn is None:
        raise CalcError(f"operator {type(op).__name__} is not allowed")
    return _check_size(fn(left, right))


class _Evaluator:
    def eval(self, node: ast.AST, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise CalcError(f"the expression is nested more than {MAX_DEPTH} levels")
        if isinstance(node, ast.Expression):
            return self.eval(node.body, depth + 1)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise CalcError(f"only numbers are allowed, not {node.value!r}"[:120])
            return _check_size(node.value)
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise CalcError(f"unknown name {node.id!r}; known constants: pi, e, tau")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
            value = self.eval(node.operand, depth + 1)
            return value if isinstance(node.op, ast.UAdd) else -value
        if isinstance(node, ast.BinOp):
            # 1+2+...+60 parses as a left spine of 59 BinOps: flat as written, so it is walked
            # in a loop at this depth. Counted a level each, a sum of 51 terms was refused.
            spine = []
            while isinstance(node, ast.BinOp):
                spine.append(node)
                node = node.left
            value = self.eval(node, depth + 1)
            for link in reversed(spine):
                value = _binop(link.op, value, self.eval(link.right, depth + 1))
            return value
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        raise CalcError(f"{type(node).__name__} is not allowed in a calculator expression")

    def _call(self, node: ast.Call, depth: int) -> Any:
        allowed = ", ".join(_FUNCTIONS)
        if not isinstance(node.func, ast.Name):
            raise CalcError(f"calling this is not allowed; allowed functions: {allowed}")
        if node.func.id not in _FUNCTIONS:
            raise CalcError(f"{node.func.id!r} is not an allowed function; allowed: {allowed}")
        if node.keywords:
            raise CalcError("keyword arguments are not allowed")
        if len(node.args) > 16:
            raise CalcError("too many function arguments")
        args = [self.eval(a, depth + 1) for a in node.args]
        return _check_size(_FUNCTIONS[node.func.id](*args))


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; raises ``CalcError`` saying why not.

    No time bound: ``agentrl.tools.calculator.evaluate`` runs this in a worker
    process under a deadline.
    """
    if len(expression) > MAX_EXPR_CHARS:
        raise CalcError(f"the expression is longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise CalcError(f"not a valid expression ({type(err).__name__})") from None
    try:
        return _Evaluator().eval(tree)
    except CalcError:
        raise
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except (OverflowError, ValueError, TypeError, ArithmeticError) as err:
        raise CalcError(f"cannot compute: {err}") from None


def format_number(value: int | float) -> str:
    """Ints as they are; floats that are whole as ints; others with 15 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".15g")
    return str(value)


def serve(memory_bytes: int = 1 << 30) -> None:
    """The worker's loop: ``{"expression": ...}`` in, ``{"value": number}`` or ``{"error": ...}`` out.

    JSON keeps every value exactly: ints of any size here, floats by their
    shortest round-trip text, and ``inf``/``nan`` as ``Infinity``/``NaN``.
    """
    try:  # a runaway intermediate fails with MemoryError instead of swapping the host
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):
        pass
    for line in sys.stdin:
        try:
            out = {"value": evaluate(json.loads(line)["expression"])}
        except CalcError as err:
            out = {"error": str(err)}
        except MemoryError:
            out = {"error": "the computation ran out of memory"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
