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
  3. scheduling (steps 3 and 4 are ``runtime.program``'s, shared with field expressions and
     the lowering of scene tapes): the file's order and a depth-first order (largest register need first) are both
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

Programs longer than ``MAX_VM_LINES`` lines or ``MAX_VM_BYTES`` bytes are refused before parsing.

The tape gets bounds [-1, 1]^3 (the ``.vm`` convention), one grey material and instance count 1.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from taperay.runtime.program import Program, program_tape
from taperay.runtime.tape import MAX_INSTRS, OPS, REG_CAPS, Op, Tape, TapeError, TaperayError

__all__ = ["load_vm", "program_tape", "Program", "VmImportError", "VmSyntaxError", "VM_OPCODES"]

# opcode name -> (tape op or None, number of id arguments): the table's ``OpSpec.vm`` names, and
# ``copy``, which the importer resolves to its argument
VM_OPCODES: dict[str, tuple[Op | None, int]] = {
    **{spec.vm: (op, len(spec.reads)) for op, spec in OPS.items() if spec.vm}, "copy": (None, 1)}
# the largest program the importer reads (prospero.vm: 7,867 lines, 149 kB): parsing takes about
# 20 us and 1 kB of memory a line, so these bound an import to seconds and a few hundred MB
MAX_VM_LINES = 1 << 18
MAX_VM_BYTES = 1 << 24
_LITERAL = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity)", re.IGNORECASE)


class VmImportError(TaperayError):
    """A ``.vm`` program cannot be imported (unreadable file, too many registers, ...)."""

    def __init__(self, source: str, reason: str, line: int | None = None):
        self.source, self.reason, self.line = source, reason, line
        super().__init__(f"{source}:{line}: {reason}" if line is not None else f"{source}: {reason}")


class VmSyntaxError(VmImportError):
    """A malformed clause: ``line`` is the 1-based line number."""


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


def _read(path_or_text) -> tuple[str, str]:
    """The program's text and its source name, refused past ``MAX_VM_BYTES`` / ``MAX_VM_LINES``
    before it is parsed."""
    text, source = _read_text(path_or_text)
    lines = text.count("\n") + 1
    if lines > MAX_VM_LINES:
        raise VmImportError(source, f"{lines:,} lines exceed the importer's limit of {MAX_VM_LINES:,}")
    return text, source


def _read_text(path_or_text) -> tuple[str, str]:
    if isinstance(path_or_text, os.PathLike) or (isinstance(path_or_text, str) and "\n" not in path_or_text):
        source = str(path_or_text)
        try:
            size = os.stat(path_or_text).st_size
            if size > MAX_VM_BYTES:
                raise VmImportError(source, f"{size:,} bytes exceed the importer's limit of {MAX_VM_BYTES:,}")
            return Path(path_or_text).read_text(encoding="utf-8-sig"), source
        except UnicodeDecodeError as e:
            raise VmImportError(source, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise VmImportError(source, f"cannot read: {e.strerror or e}") from None
    if isinstance(path_or_text, str):
        return path_or_text, "<vm text>"
    raise TypeError(f"load_vm takes a path or the program text, not {type(path_or_text).__name__}")


def load_vm(path_or_text, max_regs: int = max(REG_CAPS), balance_chains: bool = False) -> Tape:
    """Import a Fidget ``.vm`` program as a validated register tape (result in register 0).

    ``path_or_text``: a path (``os.PathLike``, or a string without a newline), or the program text
    itself (a string with at least one newline). ``max_regs``: the register budget; when the program needs more,
    small subexpressions are recomputed at each use (more instructions, fewer registers) until it
    fits, else ``VmImportError``. ``balance_chains``: MIN / MAX chains rebuilt shallow, for 2D
    images and points on the GPU (``runtime.program``, step 2; the same values).
    """
    if not 1 <= max_regs <= max(REG_CAPS):
        raise TaperayError(f"max_regs must be in 1..{max(REG_CAPS)}, got {max_regs}")
    text, source = _read(path_or_text)
    prog, root = _parse(text, source)
    try:
        return program_tape(prog, root, source, max_regs, balance_chains=balance_chains)
    except TapeError as e:
        raise VmImportError(source, e.reason) from None
