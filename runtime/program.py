"""SSA programs of tape ops and their register tapes: the hash-consed graph (``Program``), its
scheduling and register allocation (``program_tape``).

Used by the ``.vm`` importer and Python field expressions (scenegraph) and by the lowering of
scene tapes to arithmetic (``runtime.lowering``). The steps, all O(n) or O(n log n):
  1. dead nodes are dropped: only ancestors of the output are kept;
  2. on request (``balance_chains``), chains of MIN (or of MAX) are rebuilt over the same
     operands in the same order: runs of ``CHAIN_GROUP`` as balanced trees, the runs' results
     chained (``_balance_chains``; a chain's inner nodes are those read once, by the same op).
     MIN and MAX are associative and commutative in float32, so every value is the chain's, and
     so are the interval bounds (they may differ in the sign of a zero result, as hash-consing's
     sorted operands already may; a NaN operand gives NaN either way). The program's depth drops
     (prospero.vm's from 676 to 96), and the GPU prunes level 0 in dependency steps, one a level
     at most (runtime.gpu_pruning): its 2D images and points get faster. Interval pruning keeps
     more of a balanced union per tile, though (a chain compares each operand with the least of
     all before it, a tree only with its sibling), which costs 3D march cells of unions of
     scattered parts: the default keeps the chains (docs/PERFORMANCE.md, prune-gpu);
  3. scheduling: the definition order and a depth-first order (largest register need first) are
     both tried, and the one needing fewer registers is kept;
  4. register allocation by linear scan (an operand's register is freed at its last use, before
     the result is allocated; the lowest free register is taken). On straight-line code live
     ranges are intervals, so this uses exactly the maximum number of simultaneously live values:
     the minimum for that order. The output lands in register 0.
If a program needs more registers than the budget, balanced chains are given up where they need
more; small subexpressions (expression trees of up to 1, 3, 5, 8, ... 64 instructions) are
recomputed right before each use instead of being held in a register, until it fits; if even that
is not enough, ``TapeError`` says how many it needs.
"""
from __future__ import annotations

import heapq

import numpy as np

from .opcodes import REG_CAPS, Op
from .tape import INSTR_DTYPE, Tape, TapeError, material_array, validate

__all__ = ["Program", "program_tape", "GREY"]

_COMMUTATIVE = {Op.ADD, Op.MUL, Op.MIN, Op.MAX}
_ASSOCIATIVE = {Op.MIN, Op.MAX}         # exactly so in float32 (_balance_chains)
CHAIN_GROUP = 8     # operands a balanced run of a MIN / MAX chain (_balance_chains)
_RECOMPUTE_TREE_SIZES = (0, 1, 3, 5, 8, 16, 32, 64)   # recompute-instead-of-hold thresholds tried
GREY = ((0.7, 0.7, 0.7), 0.5)   # the one material of a program's tape


class Program:
    """The hash-consed SSA graph: node i has op ``ops[i]``, arguments ``args[i]`` (node indices,
    all < i), for constants the float32 value ``consts[i]``, and the record's ``aux`` (a
    FIELD_RESULT's material) ``auxs[i]``. Nodes with the same op, arguments (commutative ones
    sorted), constant bits and aux are one node."""

    def __init__(self):
        self.ops: list[Op] = []
        self.args: list[tuple[int, ...]] = []
        self.consts: list[float] = []
        self.auxs: list[int] = []
        self._key: dict[tuple, int] = {}

    def node(self, op: Op, args: tuple[int, ...], const: float = 0.0, bits: int = 0, aux: int = 0) -> int:
        if op in _COMMUTATIVE:
            args = tuple(sorted(args))
        key = (op, args, bits, aux)
        i = self._key.get(key)
        if i is None:
            i = self._key[key] = len(self.ops)
            self.ops.append(op)
            self.args.append(args)
            self.consts.append(const)
            self.auxs.append(aux)
        return i


def _live_order(prog: Program, root: int) -> list[int]:
    """The nodes the output depends on, in SSA (definition) order."""
    live = bytearray(root + 1)
    live[root] = 1
    for i in range(root, -1, -1):
        if live[i]:
            for a in prog.args[i]:
                live[a] = 1
    return [i for i in range(root + 1) if live[i]]


def _balance_chains(prog: Program, order: list[int], group: int) -> tuple[Program, int]:
    """A new program computing the same output (the last of ``order``, the live nodes in
    definition order) with each chain of MIN or MAX nodes (its inner nodes read only once, and by
    the same op) rebuilt over the chain's operands in their order: each run of ``group``
    operands as a balanced tree, the runs' results chained."""
    readers = dict.fromkeys(order, 0)
    readers[order[-1]] = 1                     # (the output's reader)
    for n in order:
        for a in prog.args[n]:
            readers[a] += 1
    inner = set()
    for n in order:
        if prog.ops[n] in _ASSOCIATIVE:
            inner.update(a for a in set(prog.args[n]) if prog.ops[a] == prog.ops[n] and readers[a] == 1)
    out = Program()
    new: dict[int, int] = {}

    def tree(op: Op, operands: list[int]) -> int:
        while len(operands) > 1:
            pairs = [out.node(op, (operands[j], operands[j + 1])) for j in range(0, len(operands) - 1, 2)]
            operands = pairs + operands[len(operands) & ~1:]
        return operands[0]

    for n in order:
        if n in inner:
            continue
        op = prog.ops[n]
        if op in _ASSOCIATIVE:
            operands, stack = [], list(reversed(prog.args[n]))
            while stack:
                a = stack.pop()
                if a in inner:
                    stack.extend(reversed(prog.args[a]))
                else:
                    operands.append(new[a])
            runs = [tree(op, operands[j:j + group]) for j in range(0, len(operands), group)]
            new[n] = runs[0]
            for r in runs[1:]:
                new[n] = out.node(op, (new[n], r))
        else:
            c = prog.consts[n]
            bits = int(np.float32(c).view(np.uint32)) if op == Op.CONST else 0
            new[n] = out.node(op, tuple(new[a] for a in prog.args[n]), c, bits, prog.auxs[n])
    return out, new[order[-1]]


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


def _emit(prog: Program, seq, dst: list[int], n_regs: int, source: str, materials) -> Tape:
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
    instrs["aux"] = np.asarray(prog.auxs, np.uint32)[nodes]
    materials = material_array([GREY[0]], GREY[1]) if materials is None else materials
    bounds = np.array([[-1, -1, -1], [1, 1, 1]], np.float32)
    return Tape(instrs, params, materials, n_regs, bounds, names={}, instance_count=1, source=source)


def program_tape(prog: Program, root: int, source: str, max_regs: int = max(REG_CAPS), materials=None,
                 reorder: bool = True, check: bool = True, balance_chains: bool = False) -> Tape:
    """Schedule and register-allocate the hash-consed program ending in ``root`` into a tape
    with ``materials`` (MATERIAL_DTYPE records; default one, GREY), validated unless ``check``
    is False (for a caller whose tape the walkers validate on use anyway, as the lowering's).
    ``balance_chains``: MIN / MAX chains rebuilt shallow (_balance_chains), tried first, then the
    program as it is where the balanced one needs more registers than ``max_regs`` at the same
    amount of recomputing. ``reorder`` False tries the definition order only (for programs built
    in a good order, as the lowering's)."""
    order = _live_order(prog, root)
    programs = [(prog, order)]
    if balance_chains:                         # (balanced chains first; they may need more registers)
        balanced, b_root = _balance_chains(prog, order, CHAIN_GROUP)
        programs.insert(0, (balanced, _live_order(balanced, b_root)))
    orders: dict[int, tuple] = {}              # each program's orders, made when it is first tried
    for max_tree in _RECOMPUTE_TREE_SIZES:
        for k, (p, live) in enumerate(programs):
            if k not in orders:
                orders[k] = (live, _depth_first_order(p, live)) if reorder else (live,)
            plans = [(seq, *_allocate(seq)) for seq in (_schedule(p, o, max_tree) for o in orders[k])]
            seq, dst, n_regs = min(plans, key=lambda q: (q[2], len(q[0])))
            if n_regs <= max_regs:
                tape = _emit(p, seq, dst, n_regs, source, materials)
                return validate(tape) if check else tape
    raise TapeError(f"the program needs {n_regs} registers even with every subexpression "
                    f"of up to {max_tree} instructions recomputed; the budget is {max_regs}", source=source)
