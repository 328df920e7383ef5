"""Importer for Fidget's ``.vm`` text format: straight-line SSA programs become register tapes.

Format (one clause a line): ``<id> <opcode> [args…]``. A line whose first token starts with ``#``
is a comment, and a token starting with ``#`` ends a clause (trailing comment); blank lines are
allowed; ids are arbitrary tokens; ``const`` takes a decimal literal (``inf`` allowed, ``nan``
not); every other argument names an id defined on an earlier line; the last clause is the output.
Opcodes: var-x var-y var-z const copy, the unary ops neg abs recip sqrt square floor ceil round
sin cos tan asin acos atan exp ln not, the binary ops add sub mul div min max atan2 compare mod
and or rand, and the ternary ``mix``. Their meaning is the opcode table's (``runtime.opcodes``),
which follows Fidget's evaluators (``and``/``or``/``not``/``compare``/``mod`` included).

Import pipeline, all O(n) or O(n log n):
  1. parse, with hash-consing: a clause identical to an earlier one (same op, same argument
     nodes, commutative arguments sorted; constants equal as float32 bits) reuses that node, and
     ``copy`` is an alias; every defect raises ``VmSyntaxError`` naming the file, line and reason;
  2. dead-clause removal: only ancestors of the output are kept;
  3. scheduling: the file's order and a depth-first order (largest register need first) are both
     tried, and the one needing fewer registers is kept;
  4. register allocation by linear scan (an operand's register is freed at its last use, before
     the result is allocated; the lowest free register is taken). On straight-line code live
     ranges are intervals, so this uses exactly the maximum number of simultaneously live values:
     the minimum for that order. The output lands in register 0.
If a program needs more registers than the budget (``max_regs``, default ``max(REG_CAPS)``),
small subexpressions (expression trees of up to 1, 3, 5, 8, ... 64 instructions) are recomputed
right before each use instead of being held in a register, until it fits; if even that is not
enough, ``VmImportError`` says how many registers it needs. There is no spilling: the kernels have
no memory beyond their register file. (prospero.vm: 189 registers as written; 54 with trees of up
to 5 instructions recomputed, at 2.3x the instructions.)

The tape gets bounds [-1, 1]^3 (the ``.vm`` convention), one grey material and instance count 1.
"""
from __future__ import annotations

import heapq
import os
import re
from pathlib import Path

import numpy as np

from taperay.runtime.tape import (INSTR_DTYPE, MATERIAL_DTYPE, MAX_INSTRS, REG_CAPS, Op, Tape,
                                  TaperayError, validate)

__all__ = ["load_vm", "program_tape", "Program", "VmImportError", "VmSyntaxError", "VM_OPCODES"]

_LEAF = {"var-x": Op.VAR_X, "var-y": Op.VAR_Y, "var-z": Op.VAR_Z}
_UNARY = {"neg": Op.NEG, "abs": Op.ABS, "recip": Op.RECIP, "sqrt": Op.SQRT, "square": Op.SQUARE,
          "floor": Op.FLOOR, "ceil": Op.CEIL, "round": Op.ROUND, "sin": Op.SIN, "cos": Op.COS,
          "tan": Op.TAN, "asin": Op.ASIN, "acos": Op.ACOS, "atan": Op.ATAN, "exp": Op.EXP,
          "ln": Op.LN, "not": Op.NOT}
_BINARY = {"add": Op.ADD, "sub": Op.SUB, "mul": Op.MUL, "div": Op.DIV, "min": Op.MIN,
           "max": Op.MAX, "atan2": Op.ATAN2, "compare": Op.COMPARE, "mod": Op.MOD, "and": Op.AND,
           "or": Op.OR, "rand": Op.RAND}
_TERNARY = {"mix": Op.MIX}
# opcode name -> (tape op or None, number of id arguments)
VM_OPCODES: dict[str, tuple[Op | None, int]] = {
    **{k: (v, 0) for k, v in _LEAF.items()}, "const": (Op.CONST, 0), "copy": (None, 1),
    **{k: (v, 1) for k, v in _UNARY.items()}, **{k: (v, 2) for k, v in _BINARY.items()},
    **{k: (v, 3) for k, v in _TERNARY.items()}}
_COMMUTATIVE = {Op.ADD, Op.MUL, Op.MIN, Op.MAX}
_RECOMPUTE_TREE_SIZES = (0, 1, 3, 5, 8, 16, 32, 64)   # recompute-instead-of-hold thresholds tried
_LITERAL = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity)", re.IGNORECASE)
GREY = ((0.7, 0.7, 0.7), 0.5)


class VmImportError(TaperayError):
    """A ``.vm`` program cannot be imported (unreadable file, too many registers, ...)."""

    def __init__(self, source: str, reason: str, line: int | None = None):
        self.source, self.reason, self.line = source, reason, line
        super().__init__(f"{source}:{line}: {reason}" if line is not None else f"{source}: {reason}")


class VmSyntaxError(VmImportError):
    """A malformed clause: ``line`` is the 1-based line number."""


class Program:
    """The hash-consed SSA graph: node i has op ``ops[i]``, arguments ``args[i]`` (node indices,
    all < i), and for constants the float32 value ``consts[i]``."""

    def __init__(self):
        self.ops: list[Op] = []
        self.args: list[tuple[int, ...]] = []
        self.consts: list[float] = []
        self._key: dict[tuple, int] = {}

    def node(self, op: Op, args: tuple[int, ...], const: float = 0.0, bits: int = 0) -> int:
        if op in _COMMUTATIVE:
            args = tuple(sorted(args))
        key = (op, args, bits)
        i = self._key.get(key)
        if i is None:
            i = self._key[key] = len(self.ops)
            self.ops.append(op)
            self.args.append(args)
            self.consts.append(const)
        return i


def _parse(text: str, source: str) -> tuple[Program, int]:
    """Parse ``text``; return the program and its output node."""
    prog = Program()
    names: dict[str, tuple[int, int]] = {}     # id -> (node, line)
    lines = text.splitlines()
    root, clauses = -1, 0
    for lineno, line in enumerate(lines, 1):
        tokens = line.split()
        for j, t in enumerate(tokens):
            if t.startswith("#"):
                del tokens[j:]
                break
        if not tokens:
            continue
        clauses += 1
        if clauses > MAX_INSTRS:
            raise VmSyntaxError(source, f"more than {MAX_INSTRS} clauses", lineno)
        out, *rest = tokens
        if not rest:
            raise VmSyntaxError(source, f"clause {out!r} has no opcode", lineno)
        opname, *operands = rest
        if opname not in VM_OPCODES:
            raise VmSyntaxError(source, f"unknown opcode {opname!r}", lineno)
        op, arity = VM_OPCODES[opname]
        if out in names:
            raise VmSyntaxError(source, f"id {out!r} is already defined on line {names[out][1]}", lineno)
        if opname == "const":
            if len(operands) != 1:
                raise VmSyntaxError(source, f"const takes 1 literal, got {len(operands)} arguments", lineno)
            lit = operands[0]
            if not _LITERAL.fullmatch(lit):
                raise VmSyntaxError(source, f"bad decimal literal {lit!r}", lineno)
            with np.errstate(over="ignore"):
                value = np.float32(float(lit))
            node = prog.node(Op.CONST, (), float(value), int(value.view(np.uint32)))
        else:
            if len(operands) != arity:
                raise VmSyntaxError(source, f"{opname} takes {arity} argument{'s' * (arity != 1)}, "
                                            f"got {len(operands)}", lineno)
            args = []
            for name in operands:
                hit = names.get(name)
                if hit is None:
                    raise _undefined(source, lines, lineno, name)
                args.append(hit[0])
            node = args[0] if op is None else prog.node(op, tuple(args))
        names[out] = (node, lineno)
        root = node
    if root < 0:
        raise VmSyntaxError(source, "the program has no clauses", len(lines) or 1)
    return prog, root


def _undefined(source: str, lines: list[str], lineno: int, name: str) -> VmSyntaxError:
    if name == lines[lineno - 1].split()[0]:
        return VmSyntaxError(source, f"id {name!r} refers to itself", lineno)
    for later, line in enumerate(lines[lineno:], lineno + 1):
        tokens = line.split()
        if tokens and tokens[0] == name:
            return VmSyntaxError(source, f"forward reference to {name!r} (defined on line {later})", lineno)
    return VmSyntaxError(source, f"undefined id {name!r}", lineno)


def _live_order(prog: Program, root: int) -> list[int]:
    """The nodes the output depends on, in SSA (definition) order."""
    live = bytearray(root + 1)
    live[root] = 1
    for i in range(root, -1, -1):
        if live[i]:
            for a in prog.args[i]:
                live[a] = 1
    return [i for i in range(root + 1) if live[i]]


def _depth_first_order(prog: Program, order: list[int]) -> list[int]:
    """Another topological order of the live nodes: post-order from the output, visiting first the
    argument whose subtree needs the most registers (Sethi-Ullman labels, sharing ignored), so each
    subexpression is computed just before it is consumed."""
    need: dict[int, int] = {}
    for n in order:
        kids = sorted((need[a] for a in set(prog.args[n])), reverse=True)
        need[n] = max([k + j for j, k in enumerate(kids)], default=1)
    out: list[int] = []
    done: set[int] = set()
    stack = [(order[-1], False)]
    while stack:
        n, expanded = stack.pop()
        if n in done:
            continue
        if expanded:
            done.add(n)
            out.append(n)
            continue
        stack.append((n, True))
        stack.extend((a, False) for a in sorted(set(prog.args[n]), key=need.__getitem__) if a not in done)
    return out


def _schedule(prog: Program, order: list[int], max_tree: int) -> list[tuple[int, tuple[int, ...]]]:
    """Instructions as (node, operand slots; slots index the returned list). Every node whose
    expression tree has at most ``max_tree`` instructions (except the output) is recomputed right
    before each use instead of being held in a register."""
    size: dict[int, int] = {}
    for n in order:
        size[n] = 1 + sum(size[a] for a in prog.args[n])
    recompute = {n for n in order[:-1] if size[n] <= max_tree}
    seq: list[tuple[int, tuple[int, ...]]] = []
    slot: dict[int, int] = {}

    def operands(n: int) -> tuple[int, ...]:
        return tuple(inline(a) if a in recompute else slot[a] for a in prog.args[n])

    def inline(n: int) -> int:
        seq.append((n, operands(n)))
        return len(seq) - 1

    for n in order:
        if n not in recompute:
            args = operands(n)
            slot[n] = len(seq)
            seq.append((n, args))
    return seq


def _allocate(seq: list[tuple[int, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Linear-scan register allocation; returns the destination register of each instruction and
    the register count. The last instruction writes register 0."""
    n = len(seq)
    last_use = list(range(n))
    for k, (_, operands) in enumerate(seq):
        for s in operands:
            last_use[s] = k
    dst = [0] * n
    free: list[int] = []
    n_regs = 0
    for k, (_, operands) in enumerate(seq):
        for s in set(operands):
            if last_use[s] == k:
                heapq.heappush(free, dst[s])
        if k == n - 1:
            r = 0              # everything else is dead by now: register 0 is free
        elif free:
            r = heapq.heappop(free)
        else:
            r, n_regs = n_regs, n_regs + 1
        dst[k] = r
    return dst, max(n_regs, 1)


def _emit(prog: Program, seq, dst: list[int], n_regs: int, source: str) -> Tape:
    n = len(seq)
    nodes = np.fromiter((node for node, _ in seq), np.int64, n)
    ops = np.asarray(prog.ops, np.uint32)[nodes]
    operands = np.zeros((n, 3), np.uint32)
    dst_arr = np.asarray(dst, np.uint32)
    for k, (_, ops_k) in enumerate(seq):
        for j, s in enumerate(ops_k):
            operands[k, j] = dst_arr[s]
    is_const = ops == Op.CONST
    const_nodes, param_of = np.unique(nodes[is_const], return_inverse=True)
    params = np.asarray(prog.consts, np.float32)[const_nodes] if len(const_nodes) else np.zeros(0, np.float32)
    instrs = np.zeros(n, INSTR_DTYPE)
    instrs["op"] = ops
    instrs["dst"] = dst_arr
    instrs["a"], instrs["b"], instrs["c"] = operands.T
    instrs["param"][is_const] = param_of.astype(np.uint32)
    materials = np.array([GREY], MATERIAL_DTYPE)
    bounds = np.array([[-1, -1, -1], [1, 1, 1]], np.float32)
    return Tape(instrs, params, materials, n_regs, bounds, names={}, instance_count=1, source=source)


def _read(path_or_text) -> tuple[str, str]:
    if isinstance(path_or_text, os.PathLike) or (isinstance(path_or_text, str) and "\n" not in path_or_text):
        source = str(path_or_text)
        try:
            return Path(path_or_text).read_text(encoding="utf-8-sig"), source
        except UnicodeDecodeError as e:
            raise VmImportError(source, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise VmImportError(source, f"cannot read: {e.strerror or e}") from None
    if isinstance(path_or_text, str):
        return path_or_text, "<vm text>"
    raise TypeError(f"load_vm takes a path or the program text, not {type(path_or_text).__name__}")


def load_vm(path_or_text, max_regs: int = max(REG_CAPS)) -> Tape:
    """Import a Fidget ``.vm`` program as a validated register tape (result in register 0).

    ``path_or_text``: a path (``os.PathLike``, or a string without a newline), or the program text
    itself (a string with at least one newline). ``max_regs``: the register budget; when the program needs more,
    small subexpressions are recomputed at each use (more instructions, fewer registers) until it
    fits, else ``VmImportError``.
    """
    if not 1 <= max_regs <= max(REG_CAPS):
        raise TaperayError(f"max_regs must be in 1..{max(REG_CAPS)}, got {max_regs}")
    text, source = _read(path_or_text)
    prog, root = _parse(text, source)
    return program_tape(prog, root, source, max_regs)


def program_tape(prog: Program, root: int, source: str, max_regs: int = max(REG_CAPS)) -> Tape:
    """Schedule and register-allocate the hash-consed program ending in ``root`` into a tape."""
    order = _live_order(prog, root)
    orders = (order, _depth_first_order(prog, order))
    for max_tree in _RECOMPUTE_TREE_SIZES:
        plans = [(seq, *_allocate(seq)) for seq in (_schedule(prog, o, max_tree) for o in orders)]
        seq, dst, n_regs = min(plans, key=lambda p: (p[2], len(p[0])))
        if n_regs <= max_regs:
            return validate(_emit(prog, seq, dst, n_regs, source))
    raise VmImportError(source, f"the program needs {n_regs} registers even with every subexpression "
                                f"of up to {max_tree} instructions recomputed; the budget is {max_regs}")
