"""Custom fields as scene nodes: expressions on x, y, z written with Python operators, or
imported ``.vm`` programs, become arithmetic sub-tapes inside a ``field`` node.

``x, y, z`` are the current local point, so a field can be transformed, patterned, combined with
primitives and given a material like any other node. ``instance_index`` is the index of the copy
the innermost enclosing pattern or instance list is evaluating (0 outside any), so a parameter can
vary along a pattern (e.g. a hole radius growing with the index) and stay O(1) per point. Expressions are hash-consed and
register-allocated by the same scheduler as the ``.vm`` importer (``runtime.program.program_tape``).
The functions (``sqrt``, ``minimum``, ``mix`` ...) are made from the opcode table: one for every op
whose ``OpSpec.field`` names it.
"""
from __future__ import annotations

import numpy as np

from taperay.runtime.tape import OPS, Family, Op, Tape, TaperayError, validate

from .nodes import Node

_FUNCTIONS = [spec for spec in OPS.values() if spec.field]      # the expression functions, by the table
__all__ = ["Expr", "x", "y", "z", "instance_index", "const", "field", "vm_field"] + [s.field for s in _FUNCTIONS]


class Expr:
    """An arithmetic expression tree (immutable); build with x, y, z, numbers and operators."""
    __slots__ = ("op", "args", "value")

    def __init__(self, op: Op, args: tuple["Expr", ...] = (), value: float = 0.0):
        self.op, self.args, self.value = op, args, value

    @staticmethod
    def lift(v) -> "Expr":
        if isinstance(v, Expr):
            return v
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise TaperayError(f"field expressions take numbers and expressions, got {v!r}") from None
        return Expr(Op.CONST, (), f)

    def _bin(self, op, other, swap=False):
        a, b = Expr.lift(self), Expr.lift(other)
        return Expr(op, (b, a) if swap else (a, b))

    def __add__(self, o): return self._bin(Op.ADD, o)
    def __radd__(self, o): return self._bin(Op.ADD, o, True)
    def __sub__(self, o): return self._bin(Op.SUB, o)
    def __rsub__(self, o): return self._bin(Op.SUB, o, True)
    def __mul__(self, o): return self._bin(Op.MUL, o)
    def __rmul__(self, o): return self._bin(Op.MUL, o, True)
    def __truediv__(self, o): return self._bin(Op.DIV, o)
    def __rtruediv__(self, o): return self._bin(Op.DIV, o, True)
    def __mod__(self, o): return self._bin(Op.MOD, o)
    def __neg__(self): return Expr(Op.NEG, (self,))
    def __abs__(self): return Expr(Op.ABS, (self,))

    def __pow__(self, k):
        if k == 2:
            return Expr(Op.SQUARE, (self,))
        raise TaperayError("field expressions support ** 2 only (use exp/ln for other powers)")

    def __repr__(self):
        return f"Expr({self.op.name}{', ' + repr(self.value) if self.op is Op.CONST else ''})"


def _function(spec):
    """The expression function of an op: as many arguments (expressions or numbers) as it reads."""
    n = len(spec.reads)

    def function(*args):
        if len(args) != n:
            raise TaperayError(f"{spec.field}() takes {n} argument{'s' * (n != 1)}, got {len(args)}")
        return Expr(spec.op, tuple(Expr.lift(a) for a in args))
    function.__name__ = function.__qualname__ = spec.field
    function.__doc__ = f"The field expression {spec.op.name}: {spec.doc}."
    return function


x, y, z = Expr(Op.VAR_X), Expr(Op.VAR_Y), Expr(Op.VAR_Z)
instance_index = Expr(Op.INSTANCE_INDEX)
const = Expr.lift
globals().update({spec.field: _function(spec) for spec in _FUNCTIONS})


def _expr_tape(root: Expr, source: str) -> Tape:
    from taperay.runtime.program import Program, program_tape
    prog = Program()
    index: dict[int, int] = {}
    stack = [(root, False)]
    while stack:                       # iterative post-order: deep expressions do not recurse
        e, ready = stack.pop()
        if id(e) in index:
            continue
        if not ready:
            stack.append((e, True))
            stack.extend((a, False) for a in e.args if id(a) not in index)
            continue
        if e.op is Op.CONST:
            v = np.float32(e.value)
            index[id(e)] = prog.node(Op.CONST, (), float(v), int(v.view(np.uint32)))
        else:
            index[id(e)] = prog.node(e.op, tuple(index[id(a)] for a in e.args))
    keep_alive = root                  # ids stay unique while the tree is referenced
    tape = program_tape(prog, index[id(keep_alive)], source)
    return tape


def field(expr_or_tape, bounds=((-1, -1, -1), (1, 1, 1)), name: str = "field") -> Node:
    """A node whose value is an arithmetic expression or arithmetic tape of x, y, z.

    ``bounds``: a box that holds the field's surface (used for framing and culling); the field
    must be a distance bound (1-Lipschitz) for sphere tracing to be exact.
    """
    if isinstance(expr_or_tape, Tape):
        tape = expr_or_tape
    elif isinstance(expr_or_tape, (Expr, int, float)):
        tape = _expr_tape(Expr.lift(expr_or_tape), name)
    else:
        raise TaperayError(f"field() takes an expression or an arithmetic tape, got {type(expr_or_tape).__name__}")
    ops = {Op(int(o)) for o in np.unique(tape.instrs["op"])}
    bad = sorted(o.name for o in ops if OPS[o].family is not Family.ARITH)
    if bad:
        raise TaperayError(f"{tape.source or name}: a field holds arithmetic ops only, not {', '.join(bad)}")
    validate(tape)
    b = np.asarray(bounds, float).reshape(2, 3)
    return Node("field", (*b[0], *b[1]), (), None, None, tape)


def vm_field(path, bounds=((-1, -1, -1), (1, 1, 1))) -> Node:
    """A Fidget ``.vm`` program as a scene node."""
    from .vm import load_vm
    return field(load_vm(path), bounds)
