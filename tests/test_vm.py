"""The Fidget ``.vm`` importer: every model imports and computes what the SSA program computes;
malformed programs are rejected with file and line; dead code, duplicates and registers shrink."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from taperay.runtime.opcodes import OPS
from taperay.runtime.tape import REG_CAPS, Op, TaperayError
from taperay.scenegraph.vm import VM_OPCODES, VmImportError, VmSyntaxError, load_vm

DATA = Path(__file__).parent / "data"
MODELS = ["quarter", "hi", "sphere", "tanglecube", "prospero"]
CLAUSES = {"quarter": 9, "hi": 56, "sphere": 11, "tanglecube": 20, "prospero": 7866}


# -- two independent float64 interpreters -------------------------------------------------------
def _fidget_round(a):
    return np.sign(a) * np.floor(np.abs(a) + 0.5)        # Rust f64::round: half away from zero


def _fidget_compare(a, b):
    out = np.where(a < b, -1.0, np.where(a > b, 1.0, 0.0))
    return np.where(np.isnan(a) | np.isnan(b), np.nan, out)


def _fidget_mod(a, b):                                   # Rust f64::rem_euclid
    r = np.fmod(a, b)
    return np.where(r < 0, r + np.abs(b), r)


# Fidget's semantics written out here, independently of runtime.opcodes (rand has no Fidget
# counterpart: its hash is the one thing taken from the opcode table)
SSA_SEMANTICS = {
    "neg": np.negative, "abs": np.abs, "recip": lambda a: 1.0 / a, "sqrt": np.sqrt,
    "square": lambda a: a * a, "floor": np.floor, "ceil": np.ceil, "round": _fidget_round,
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos,
    "atan": np.arctan, "exp": np.exp, "ln": np.log, "not": lambda a: np.where(a == 0, 1.0, 0.0),
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "min": np.minimum, "max": np.maximum, "atan2": np.arctan2, "compare": _fidget_compare,
    "mod": _fidget_mod, "and": lambda a, b: np.where(a == 0, a, b),
    "or": lambda a, b: np.where(a != 0, a, b), "mix": lambda a, b, c: a + (b - a) * c,
    "rand": OPS[Op.RAND].reference,
}


def eval_ssa(text: str, pts: np.ndarray) -> np.ndarray:
    """Evaluate the program clause by clause in float64 (constants rounded to float32, as a tape
    stores them)."""
    env: dict[str, np.ndarray] = {}
    last = None
    with np.errstate(all="ignore"):
        for line in text.splitlines():
            tok = line.split("#")[0].split()
            if not tok:
                continue
            out, op, *args = tok
            if op in ("var-x", "var-y", "var-z"):
                v = pts[:, "xyz".index(op[-1])].astype(np.float64)
            elif op == "const":
                v = np.full(len(pts), float(np.float32(float(args[0]))))
            elif op == "copy":
                v = env[args[0]]
            else:
                v = SSA_SEMANTICS[op](*(env[a] for a in args))
            env[out] = last = v
    return last


def eval_tape(tape, pts: np.ndarray) -> np.ndarray:
    """Evaluate the register tape in float64 with the opcode table's references."""
    reg = np.full((tape.n_regs, len(pts)), np.nan)
    with np.errstate(all="ignore"):
        for op, dst, a, b, c, param, *_ in tape.as_columns().tolist():
            op = Op(op)
            if op in (Op.VAR_X, Op.VAR_Y, Op.VAR_Z):
                reg[dst] = pts[:, op - Op.VAR_X]
            elif op is Op.CONST:
                reg[dst] = float(tape.params[param])
            else:
                reads = [reg[r] for f, r in zip("abc", (a, b, c)) if f in OPS[op].reads]
                reg[dst] = OPS[op].reference(*reads)
    return reg[0]


def _points(n=4096, seed=0):
    return np.random.default_rng(seed).uniform(-1.2, 1.2, (n, 3))


ARITH_NAMES = sorted(n for n in VM_OPCODES if n not in ("var-x", "var-y", "var-z", "const", "copy"))
PRELUDE = "x var-x\ny var-y\nz var-z\nk const 2.5\nh const 0.5\ns mul x k\nxy copy s\nt add y h\n"


def _op_points(n=20000, seed=2):
    pts = _points(n, seed)
    pts[::7] = np.round(pts[::7])                          # zeros (and/or/not), ties (round)
    pts[::11, 1] = pts[::11, 0] * 2.5 - 0.5                # compare: equal operands
    return pts


def _all_ops_program() -> str:
    lines, names = [PRELUDE.rstrip()], []
    for i, name in enumerate(ARITH_NAMES):
        arity = VM_OPCODES[name][1]
        lines.append(f"u{i} {name} {' '.join(['xy', 't', 'z', 'xy'][i % 2:][:arity])}")
        names.append(f"u{i}")
    acc = names[0]
    for j, nm in enumerate(names[1:]):
        lines.append(f"acc{j} add {acc} {nm}")
        acc = f"acc{j}"
    return "\n".join(lines) + "\n"


# -- models -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_model_imports(model):
    tape = load_vm(DATA / f"{model}.vm")
    assert 0 < len(tape) <= CLAUSES[model]
    assert 1 <= tape.n_regs <= max(REG_CAPS)
    assert tape.source.endswith(f"{model}.vm")
    np.testing.assert_array_equal(tape.bounds, [[-1, -1, -1], [1, 1, 1]])
    assert tape.instance_count == 1 and len(tape.materials) == 1 and tape.names == {}
    used = {int(r) for r in tape.instrs["dst"]}
    assert max(used) == tape.n_regs - 1                  # no register is counted but unused
    assert tape.instrs["dst"][-1] == 0


@pytest.mark.parametrize("model", MODELS)
def test_tape_computes_the_ssa_program_exactly(model):
    text = (DATA / f"{model}.vm").read_text()
    pts = _points()
    np.testing.assert_array_equal(eval_tape(load_vm(DATA / f"{model}.vm"), pts), eval_ssa(text, pts))


@pytest.mark.slow
@pytest.mark.parametrize("max_regs", [64, 16, 8])
def test_register_budget_recomputes_and_stays_exact(max_regs):
    text = (DATA / "prospero.vm").read_text()
    full = load_vm(DATA / "prospero.vm")
    tape = load_vm(DATA / "prospero.vm", max_regs=max_regs)
    assert tape.n_regs <= max_regs < full.n_regs
    assert len(tape) > len(full)                         # paid for with recomputation
    pts = _points(1024, seed=1)
    np.testing.assert_array_equal(eval_tape(tape, pts), eval_ssa(text, pts))


@pytest.mark.parametrize("name", ARITH_NAMES)
def test_each_opcode_computes_exactly(name):
    arity = VM_OPCODES[name][1]
    text = PRELUDE + f"out {name} {' '.join(['xy', 't', 'z'][:arity])}\n"
    tape = load_vm(text)
    assert Op(int(tape.instrs["op"][-1])) is VM_OPCODES[name][0]
    pts = _op_points()
    ref = eval_ssa(text, pts)
    assert np.isfinite(ref).any()
    np.testing.assert_array_equal(eval_tape(tape, pts), ref)


@pytest.mark.parametrize("name", ARITH_NAMES)
def test_each_opcode_on_special_values(name):
    """Infinities, signed zeros, NaN and ties: the opcode table agrees with Fidget's semantics."""
    special = [-np.inf, -2.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.5, np.inf, np.nan]
    pts = np.array(np.meshgrid(special, special, special)).reshape(3, -1).T
    arity = VM_OPCODES[name][1]
    text = f"x var-x\ny var-y\nz var-z\nout {name} {' '.join('xyz'[:arity])}\n"
    np.testing.assert_array_equal(eval_tape(load_vm(text), pts), eval_ssa(text, pts))


def test_all_opcodes_in_one_tape():
    text = _all_ops_program()
    tape = load_vm(text)
    used = {Op(int(o)) for o in tape.instrs["op"]}
    assert {op for op, _ in VM_OPCODES.values() if op is not None} <= used
    pts = _op_points()
    np.testing.assert_array_equal(eval_tape(tape, pts), eval_ssa(text, pts))


# -- the importer's reductions ------------------------------------------------------------------
def test_dead_clauses_are_dropped():
    text = "x var-x\ny var-y\ndead1 sin y\ndead2 mul dead1 x\nr square x\nunused const 7\nout neg r\n"
    tape = load_vm(text)
    assert [Op(int(o)) for o in tape.instrs["op"]] == [Op.VAR_X, Op.SQUARE, Op.NEG]
    assert len(tape.params) == 0


def test_duplicates_are_shared():
    text = """x var-x
y var-y
c1 const 1
c2 const 1.0
c3 const 1e0
s1 add x y
s2 add y x
d1 sub x y
d2 sub y x
p1 mul s1 c1
p2 mul c3 s2
q max p1 p2
r min d1 d2
out add q r
"""
    tape = load_vm(text)
    ops = [Op(int(o)) for o in tape.instrs["op"]]
    assert ops.count(Op.CONST) == 1 and len(tape.params) == 1      # identical constants
    assert ops.count(Op.ADD) == 2                                  # x+y == y+x, and the output
    assert ops.count(Op.SUB) == 2                                  # x-y and y-x differ
    assert ops.count(Op.MUL) == 1                                  # c1*(x+y) == 1e0*(y+x)
    imax = ops.index(Op.MAX)                                       # max(p, p): one register
    assert tape.instrs["a"][imax] == tape.instrs["b"][imax]
    pts = _points(512)
    np.testing.assert_array_equal(eval_tape(tape, pts), eval_ssa(text, pts))


def test_prospero_reductions():
    tape = load_vm(DATA / "prospero.vm")
    assert len(tape) < CLAUSES["prospero"]
    assert len(np.unique(tape.params.view(np.uint32))) == len(tape.params)   # each constant once


def test_copy_is_an_alias():
    tape = load_vm("a var-x\nb copy a\nc copy b\nout add b c\n")
    assert [Op(int(o)) for o in tape.instrs["op"]] == [Op.VAR_X, Op.ADD]


def _max_live(tape) -> int:
    """The most values a register tape keeps at once: at instruction k, its own result plus every
    value written before k and read after k."""
    cols = tape.as_columns().tolist()
    writer: dict[int, int] = {}        # register -> instruction whose value it holds
    last_read = list(range(len(cols)))
    for k, (op, dst, a, b, c, *_) in enumerate(cols):
        for f, r in zip("abc", (a, b, c)):
            if f in OPS[Op(op)].reads:
                last_read[writer[r]] = k
        writer[dst] = k
    alive = np.ones(len(cols) + 1, np.int64)
    diff = np.zeros(len(cols) + 1, np.int64)
    for k, end in enumerate(last_read):     # value k is held strictly between k and end
        if end > k + 1:
            diff[k + 1] += 1
            diff[end] -= 1
    return int((alive + np.cumsum(diff))[:-1].max())


@pytest.mark.parametrize("model", MODELS)
def test_registers_equal_the_live_values(model):
    """Linear scan is optimal for its order: registers == the most values alive at once."""
    tape = load_vm(DATA / f"{model}.vm")
    assert tape.n_regs == _max_live(tape)


def test_scheduling_beats_a_breadth_first_file_order():
    """A sum of 64 terms written leaves-first needs 64 registers in file order, 7 depth-first."""
    lines = ["x var-x"] + [f"c{i} const {i + 1}" for i in range(64)]
    lines += [f"t{i} mul x c{i}" for i in range(64)]
    level = [f"t{i}" for i in range(64)]
    k = 0
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[::2], level[1::2]):
            lines.append(f"s{k} add {a} {b}")
            nxt.append(f"s{k}")
            k += 1
        level = nxt
    text = "\n".join(lines) + "\n"
    tape = load_vm(text)
    assert tape.n_regs <= 8
    pts = _points(256)
    np.testing.assert_array_equal(eval_tape(tape, pts), eval_ssa(text, pts))


def _depth(tape) -> int:
    """The longest chain of records, each reading the one before (the program's depth)."""
    depth: dict[int, int] = {}
    for op, dst, a, b, c, *_ in tape.as_columns().tolist():
        reads = [depth.get(r, 0) for f, r in zip("abc", (a, b, c)) if f in OPS[Op(op)].reads]
        depth[dst] = 1 + max(reads) if reads else 0
    return depth[0]


@pytest.mark.slow
def test_balanced_chains_are_shallow_and_compute_the_same_image(cpu_walker):
    """prospero.vm's union of 665 pieces is one MIN chain: depth 676 as written, and by default;
    balanced (runs of CHAIN_GROUP) far shallower, with the same field, bit for bit."""
    chain, balanced = load_vm(DATA / "prospero.vm"), load_vm(DATA / "prospero.vm", balance_chains=True)
    assert _depth(chain) == 676 and _depth(balanced) < 200 and len(balanced) <= len(chain)
    rect = (-1.0, 1.0, -1.0, 1.0)
    np.testing.assert_array_equal(cpu_walker.field_image(chain, 160, 160, rect),
                                  cpu_walker.field_image(balanced, 160, 160, rect))


def test_balanced_chains_keep_shared_values_and_other_ops_apart():
    """A chain of 300 MAX with an inner value read twice, inside a MIN chain: the shared value
    stays, MIN and MAX are not merged, and every value is the program's."""
    lines = ["x var-x", "y var-y"]
    for i in range(300):
        lines += [f"c{i} const {i * 0.01 - 1.5}", f"t{i} add c{i} y"]
    lines += ["m0 max t0 t1"] + [f"m{i} max m{i - 1} t{i + 1}" for i in range(1, 299)]
    lines += ["n0 min m150 x", "n1 min n0 m298", "out add n1 m150"]    # m150: read twice
    text = "\n".join(lines) + "\n"
    tape = load_vm(text, balance_chains=True)
    assert _depth(tape) < 150
    ops = [Op(int(o)) for o in tape.instrs["op"]]
    assert ops.count(Op.MAX) == 299 and ops.count(Op.MIN) == 2      # the same ops, none merged across
    pts = _points(2048, seed=3)
    pts[::5, :2] = np.round(pts[::5, :2])                            # ties between operands
    np.testing.assert_array_equal(eval_tape(tape, pts), eval_ssa(text, pts))


def test_impossible_budget_is_reported():
    with pytest.raises(VmImportError, match="needs 2 registers.*budget is 1"):
        load_vm("x var-x\ny var-y\nout add x y\n", max_regs=1)
    with pytest.raises(TaperayError, match="max_regs"):
        load_vm("x var-x\n", max_regs=0)


def test_single_clause_programs():
    assert [Op(int(o)) for o in load_vm("x var-x\n").instrs["op"]] == [Op.VAR_X]
    tape = load_vm("# only a constant\nc const -2.5\n")
    assert tape.params.tolist() == [-2.5] and tape.n_regs == 1


# -- malformed programs -------------------------------------------------------------------------
@pytest.mark.parametrize("text, line, reason", [
    ("x var-x\ny frobnicate x\n", 2, "unknown opcode 'frobnicate'"),
    ("x var-x\ny neg q\n", 2, "undefined id 'q'"),
    ("x var-x\ny neg x\nx var-y\n", 3, "already defined on line 1"),
    ("x var-x\nc const 1.2.3\n", 2, "bad decimal literal '1.2.3'"),
    ("c const nan\n", 1, "bad decimal literal 'nan'"),
    ("c const 1_000\n", 1, "bad decimal literal"),
    ("c const 0x10\n", 1, "bad decimal literal"),
    ("c const\n", 1, "const takes 1 literal, got 0"),
    ("c const 1 2\n", 1, "const takes 1 literal, got 2"),
    ("x var-x\ny add x\n", 2, "add takes 2 arguments, got 1"),
    ("x var-x\ny neg x x\n", 2, "neg takes 1 argument, got 2"),
    ("x var-x 3\n", 1, "var-x takes 0 arguments, got 1"),
    ("x var-x\ny mix x x\n", 2, "mix takes 3 arguments, got 2"),
    ("x var-x\n\n# c\ny add x z\nz var-y\n", 4, "forward reference to 'z' (defined on line 5)"),
    ("y neg y\n", 1, "refers to itself"),
    ("lonely\n", 1, "has no opcode"),
    ("# nothing\n\n   \n", 3, "no clauses"),
    ("", 1, "no clauses"),
])
def test_malformed_programs_name_file_line_and_reason(tmp_path, text, line, reason):
    p = tmp_path / "bad.vm"
    p.write_text(text)
    with pytest.raises(VmSyntaxError) as info:
        load_vm(p)
    e = info.value
    assert e.line == line and e.source == str(p) and reason in e.reason
    assert str(e).startswith(f"{p}:{line}: ")
    with pytest.raises(VmSyntaxError, match=f"^<vm text>:{line}: "):
        load_vm(text + "\n" if "\n" not in text else text)


def test_comments_and_blank_lines_are_ignored():
    text = "# header\n\n  x var-x   # trailing comment\n\ty var-y\n#x var-z\nout max x y # done\n"
    tape = load_vm(text)
    pts = _points(64)
    np.testing.assert_array_equal(eval_tape(tape, pts), np.maximum(pts[:, 0], pts[:, 1]))


def test_unreadable_files(tmp_path):
    with pytest.raises(VmImportError, match="cannot read"):
        load_vm(tmp_path / "missing.vm")
    p = tmp_path / "latin1.vm"
    p.write_bytes(b"x var-x # caf\xe9\n")
    with pytest.raises(VmImportError, match="not UTF-8"):
        load_vm(p)
    with pytest.raises(VmImportError, match="cannot read"):
        load_vm(str(tmp_path))


def test_infinite_literal_is_accepted_and_overflow_rounds_to_inf():
    tape = load_vm("a const inf\nb const -1e39\nout add a b\n")
    assert sorted(tape.params.tolist()) == [-np.inf, np.inf]


# -- against the float32 CPU walker -------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_walker():
    cpu = pytest.importorskip("taperay.runtime.cpu")
    return cpu.CpuWalker()


@pytest.mark.parametrize("model", MODELS)
def test_cpu_walker_agrees_with_float64(cpu_walker, model):
    text = (DATA / f"{model}.vm").read_text()
    tape = load_vm(DATA / f"{model}.vm")
    pts = _points(4096, seed=3)
    dist, mat = cpu_walker.evaluate(tape, pts.astype(np.float32))
    ref = eval_ssa(text, pts.astype(np.float32).astype(np.float64))
    assert dist.dtype == np.float32 and np.all(mat == 0)
    # float32 evaluation of these programs (add/sub/mul/square/sqrt/min/max/neg chains) loses a few
    # ulps (2^-24 relative) of the largest intermediate per step over ~10 steps, intermediates below
    # ~100: 1e-5 relative bounds that (measured: at most 1.4e-6, on tanglecube)
    err = np.abs(dist.astype(np.float64) - ref)
    assert np.all(err <= 1e-5 * (1 + np.abs(ref))), float(err.max())


@pytest.mark.slow
def test_prospero_image_matches_the_reference(cpu_walker):
    """The challenge's image: pixel centres at linspace(-1, 1, 1024), row 0 at y = +1, 255 where
    f < 0. field_image puts pixel centres at x0 + (i + 1/2) (x1 - x0) / n, so the rect is widened by
    half a pixel of the linspace spacing."""
    from PIL import Image
    ref = np.asarray(Image.open(DATA / "prospero_1024.png")) == 255
    n = 1024
    h = 1.0 / (n - 1)
    field = cpu_walker.field_image(load_vm(DATA / "prospero.vm"), n, n, rect=(-1 - h, 1 + h, -1 - h, 1 + h))
    assert field.shape == (n, n) and field.dtype == np.float32
    differ = (field < 0) != ref
    assert differ.mean() <= 1e-4, int(differ.sum())
    if differ.any():                                     # only where f is at float32 rounding
        xs = np.linspace(-1, 1, n)
        X, Y = np.meshgrid(xs, -xs)
        pts = np.stack([X[differ], Y[differ], np.zeros(differ.sum())], 1)
        f64 = eval_ssa((DATA / "prospero.vm").read_text(), pts)
        assert np.all(np.abs(f64) < 1e-5), np.abs(f64).max()
