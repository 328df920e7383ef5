"""The sparse solve (solvers.fem.solve_linear): AMG-CG on TET10 elasticity and heat against the
direct solver, plain and with the two-level preconditioner (the P1 space on the corner nodes), its
stopping test on the true residual and at the rounding floor, the fallback to the direct solver with
its reason, the error when that would not fit in memory, and the solver's report in a simulation's
summary."""
import numpy as np
import pytest

from taperay.runtime.tape import TaperayError
from taperay.scenegraph import Material, box, flatten, intersection, plane
from taperay.solvers import Elasticity, fem, simulate
from taperay.solvers.tetmesh import box_mesh


def _beam(n=(48, 4, 4), roller=False):
    """A TET10 beam 10 x 1 x 1 (E 1000, nu 0.3) of n cubes, clamped at x = 0, a uniform shear
    traction on its end x = 10; ``roller``: its side y = -0.5 also held in y only (nodes with some
    dofs fixed). Returns (K, f, fixed dofs, rigid-body modes, the mesh)."""
    L = 10.0
    m = box_mesh(n, (0, -0.5, -0.5), (L, 0.5, 0.5), order=2)
    K, f = fem.elasticity_system(m.nodes, m.elements, 1000.0, 0.3)
    faces = m.boundary_faces()
    x = m.nodes[faces]
    f += fem.face_load(m.nodes, faces[np.all(np.isclose(x[:, :, 0], L), 1)], (0.0, 0.0, -1.0), 3, len(m.nodes))
    wall = np.unique(faces[np.all(np.isclose(x[:, :, 0], 0), 1)])
    fixed = (3 * wall[:, None] + np.arange(3)).ravel()
    if roller:
        side = np.setdiff1d(np.unique(faces[np.all(np.isclose(x[:, :, 1], -0.5), 1)]), wall)
        fixed = np.concatenate([fixed, 3 * side + 1])
    return K, f, fixed, fem.rigid_body_modes(m.nodes), m


def _true_residual(K, f, u, fixed):
    free = np.ones(len(f), bool)
    free[fixed] = False
    r = f[free] - K[free] @ u
    return np.linalg.norm(r) / np.linalg.norm(f[free] - K[free][:, ~free] @ u[~free])


def _floor_stop_or_none(info):
    """No note, or the note of a stop at the rounding floor (above AMG_RTOL, below its bound)."""
    note = info.get("note")
    assert note is None or (note.startswith("AMG-CG reached the rounding floor at relative residual ")
                            and "within 10 times this system's rounding floor" in note), note
    assert info["residual"] <= fem.AMG_RESIDUAL_LIMIT


@pytest.mark.parametrize("two_level", [False, True])
def test_auto_takes_amg_above_the_direct_limit_and_agrees_with_the_direct_solve(two_level):
    """23,328 free dofs: AMG-CG (whole nodes aggregated, the rigid-body modes as B; with the mesh,
    the two-level preconditioner) to the rounding floor, within 1e-8 of the direct solution (measured
    1e-11), in a bounded number of iterations (measured: 38 plain, 19 two-level)."""
    K, f, fixed, B, mesh = _beam()
    zeros = np.zeros(len(fixed))
    ua, info = fem.solve_linear(K, f, fixed, zeros, "auto", B, mesh=mesh if two_level else None)
    assert info["free"] > fem.DIRECT_MAX_DOF and info["method"] == "amg"
    assert info.get("preconditioner") == ("two-level" if two_level else None)
    assert 0 < info["iterations"] < (35 if two_level else 60)
    assert info["residual"] == pytest.approx(_true_residual(K, f, ua, fixed), rel=1e-6)
    _floor_stop_or_none(info)
    ud, dinfo = fem.solve_linear(K, f, fixed, zeros, "direct")
    assert dinfo["method"] == "direct" and dinfo["residual"] == pytest.approx(_true_residual(K, f, ud, fixed), rel=1e-6)
    assert np.linalg.norm(ua - ud) / np.linalg.norm(ud) < 1e-8


def test_amg_with_nodes_partly_fixed_agrees_with_the_direct_solve(monkeypatch):
    """A roller side (y held, x and z free) splits nodes: the aggregation is by dof, still
    converging, plain and two-level (a coarse dof of a held corner component is dropped), and
    two-level with SLIVER_DEGREES at 40 (the exact solve on the dofs of the elements with an angle
    below 40 degrees, some of them held, in the smoother)."""
    K, f, fixed, B, mesh = _beam((24, 3, 3), roller=True)
    zeros = np.zeros(len(fixed))
    ud, dinfo = fem.solve_linear(K, f, fixed, zeros, "direct")
    for given, degrees in ((None, fem.SLIVER_DEGREES), (mesh, fem.SLIVER_DEGREES), (mesh, 40.0)):
        monkeypatch.setattr(fem, "SLIVER_DEGREES", degrees)
        assert degrees < 40 or len(fem.sliver_blocks(mesh.nodes, mesh.elements, 3)) > 0
        ua, info = fem.solve_linear(K, f, fixed, zeros, "amg", B, mesh=given)
        assert info["method"] == "amg" and 0 < info["iterations"] < 100
        _floor_stop_or_none(info)
        assert np.linalg.norm(ua - ud) / np.linalg.norm(ud) < 1e-8


def test_two_level_takes_fewer_iterations_than_plain_amg_on_tet10_heat_and_elasticity():
    """TET10 heat (a box held at one end, a source) and elasticity (the beam): the two-level
    preconditioner's solution is the direct one within 1e-8, in fewer CG iterations than plain
    smoothed aggregation (measured: heat 8 against 34, elasticity 23 against 57)."""
    m = box_mesh((16, 4, 4), (0, 0, 0), (4.0, 1.0, 1.0), order=2)
    K, f = fem.heat_system(m.nodes, m.elements, 2.0, 1.0)
    fixed = np.flatnonzero(np.isclose(m.nodes[:, 0], 0))
    Kb, fb, fixed_b, B, mb = _beam((12, 2, 2))
    for K, f, fixed, B, mesh in ((K, f, fixed, None, m), (Kb, fb, fixed_b, B, mb)):
        zeros = np.zeros(len(fixed))
        ud, _ = fem.solve_linear(K, f, fixed, zeros, "direct")
        plain, pinfo = fem.solve_linear(K, f, fixed, zeros, "amg", B)
        two, tinfo = fem.solve_linear(K, f, fixed, zeros, "amg", B, mesh=mesh)
        assert tinfo["preconditioner"] == "two-level" and "preconditioner" not in pinfo
        for u in (plain, two):
            assert np.linalg.norm(u - ud) / np.linalg.norm(ud) < 1e-8
        assert 0 < tinfo["iterations"] < pinfo["iterations"], (tinfo, pinfo)


def test_p1_prolongation_reproduces_linear_fields_and_holds_fixed_dofs():
    """P maps a linear field's corner values to its values at every TET10 node (per component);
    a fixed dof's row is zero but for its own coarse dof at a fixed corner."""
    m = box_mesh((3, 2, 2), order=2)
    a = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    field = m.nodes @ a.T + [0.1, 0.2, 0.3]                    # (N, 3)
    P, fine_of = fem.p1_prolongation(m.elements, len(m.nodes), 3)
    assert P.shape == (3 * len(m.nodes), len(fine_of))
    assert np.allclose(P @ field.ravel()[fine_of], field.ravel(), atol=1e-14)
    corner, mid = int(m.elements[0, 0]), int(m.elements[0, 4])
    fixed = np.array([3 * corner, 3 * mid + 1])
    Pf, _ = fem.p1_prolongation(m.elements, len(m.nodes), 3, fixed)
    column = int(np.flatnonzero(fine_of == 3 * corner)[0])
    assert Pf[3 * corner].nnz == 1 and Pf[3 * corner, column] == 1.0 and Pf[3 * mid + 1].nnz == 0
    assert Pf[:, column].nnz == 1


def test_amg_stopped_early_falls_back_to_the_direct_solver_and_says_why():
    K, f, fixed, B, _ = _beam((24, 3, 3))
    zeros = np.zeros(len(fixed))
    u, info = fem.solve_linear(K, f, fixed, zeros, "amg", B, maxiter=2)
    assert info["method"] == "amg → direct" and info["iterations"] == 2
    assert info["note"].startswith("AMG-CG reached its 2-iteration limit at relative residual ")
    assert info["note"].endswith("after 2 iterations; solved by the direct solver instead")
    ud, dinfo = fem.solve_linear(K, f, fixed, zeros, "direct")
    assert np.array_equal(u, ud) and info["residual"] == dinfo["residual"]
    assert info["residual"] == pytest.approx(_true_residual(K, f, u, fixed), rel=1e-6)


def test_a_matrix_cg_cannot_solve_falls_back_to_the_direct_solver():
    """A symmetric indefinite matrix (a heat stiffness less twice its smallest eigenvalue): CG's
    p.Ap turns negative (or it stalls); the direct solver solves it."""
    from scipy.sparse.linalg import eigsh
    m = box_mesh((6, 6, 6))
    K, _ = fem.heat_system(m.nodes, m.elements, 1.0)
    fixed = np.unique(m.boundary_faces())
    free = np.setdiff1d(np.arange(len(m.nodes)), fixed)
    lowest = eigsh(K[free][:, free], 1, sigma=0, which="LM", return_eigenvectors=False)[0]
    A = (K - 2 * lowest * fem.sp.eye(K.shape[0])).tocsr()
    f = np.random.default_rng(0).standard_normal(len(m.nodes))
    u, info = fem.solve_linear(A, f, fixed, np.zeros(len(fixed)), "amg")
    assert info["method"] == "amg → direct", info
    assert info["note"].startswith(("AMG-CG broke down", "AMG-CG stalled", "AMG-CG diverged"))
    assert info["residual"] < 1e-10


@pytest.mark.parametrize("two_level", [False, True])
def test_an_unreachable_tolerance_stops_at_the_rounding_floor_with_its_note(two_level):
    """rtol 1e-30: the true residual stops at round-off; CG stops within FLOOR_FACTOR of the floor's
    estimate (``fem.rounding_floor``, the PETSc path's too), keeps its best iterate, no fallback,
    and the note says so (the direct solution within 1e-8)."""
    K, f, fixed, B, mesh = _beam((12, 2, 2))
    u, info = fem.solve_linear(K, f, fixed, np.zeros(len(fixed)), "amg", B, rtol=1e-30, mesh=mesh if two_level else None)
    ud, dinfo = fem.solve_linear(K, f, fixed, np.zeros(len(fixed)), "direct")
    assert info["method"] == "amg" and info["iterations"] < fem.AMG_MAXITER
    note = info["note"]
    assert note.startswith(f"AMG-CG reached the rounding floor at relative residual {info['residual']:.2g} after "
                           f"{info['iterations']} iterations, within 10 times this system's rounding floor (about ")
    assert note.endswith(": float64's epsilon times |A| |x| against |b|); the target 1e-30 is not reached")
    floor = float(note.split("(about ")[1].split(":")[0])
    assert dinfo["residual"] < floor and info["residual"] <= fem.FLOOR_FACTOR * floor < fem.AMG_RESIDUAL_LIMIT
    assert np.linalg.norm(u - ud) / np.linalg.norm(ud) < 1e-8


def test_a_fallback_that_would_not_fit_in_memory_is_one_error_naming_the_other_solvers(monkeypatch):
    monkeypatch.setattr(fem, "available_memory", lambda: 1000)
    K, f, fixed, B, _ = _beam((12, 2, 2))
    with pytest.raises(TaperayError) as e:
        fem.solve_linear(K, f, fixed, np.zeros(len(fixed)), "amg", B, maxiter=2)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("the linear solve failed (amg: AMG-CG reached its 2-iteration limit at relative residual")
    assert "the direct solver would need about" in message and "1 kB available" in message
    assert "--solver petsc" in message and "--solver direct" not in message


def test_a_direct_solve_that_would_not_fit_in_memory_is_refused_before_the_factorisation(monkeypatch):
    """--solver direct (and auto's direct below DIRECT_MAX_DOF) with too little memory for
    ``direct_memory``'s estimate: one error naming both figures and the other solvers, SuperLU never
    called; with the memory there, the same solve runs."""
    K, f, fixed, B, _ = _beam((12, 2, 2))
    zeros = np.zeros(len(fixed))
    free = np.setdiff1d(np.arange(K.shape[0]), fixed)
    need = fem.direct_memory(K[free][:, free])
    factorised = []
    real_lu = fem.symmetric_lu
    monkeypatch.setattr(fem, "symmetric_lu", lambda A: factorised.append(A.shape) or real_lu(A))
    monkeypatch.setattr(fem, "available_memory", lambda: need - 1)
    for method in ("direct", "auto"):
        with pytest.raises(TaperayError) as e:
            fem.solve_linear(K, f, fixed, zeros, method, B)
        message = str(e.value)
        assert "\n" not in message and message.startswith("the direct solver would need about ")
        assert f"for {len(free):,} free DOF (an estimate)" in message and "--solver amg" in message
    assert factorised == []
    monkeypatch.setattr(fem, "available_memory", lambda: need)
    u, info = fem.solve_linear(K, f, fixed, zeros, "direct", B)
    assert info["method"] == "direct" and factorised == [(len(free), len(free))] and info["residual"] < 1e-9


def test_simulate_solver_direct_that_would_not_fit_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    from taperay.tools.cli import main
    scene = tmp_path / "shell.py"
    scene.write_text("from taperay.scenegraph import Material, difference, sphere, union\n"
                     "outer, inner = Material('outer'), Material('inner')\n"
                     "scene = union(difference(sphere(1.0).material(outer), sphere(0.51)),\n"
                     "              difference(sphere(0.52).material(inner), sphere(0.5)))\n"
                     "study = {'type': 'heat', 'conductivity': 1.0, 'fixed_temperature': {'inner': 1.0},\n"
                     "         'convection': {'outer': (10.0, 0.0)}}\n")
    monkeypatch.setattr(fem, "available_memory", lambda: 1000)
    out = tmp_path / "out.vtu"
    code = main(["simulate", str(scene), "--resolution", "10", "--walker", "cpu", "--solver", "direct", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert len(err) == 1 and err[0].startswith(f"taperay: error: {scene}: the direct solver would need about "), err
    assert err[0].endswith("1 kB available; use --solver amg (CG + pyamg) or --solver petsc (CG + GAMG over MPI ranks)")


def test_direct_memory_is_in_the_measured_range():
    """The estimate against SuperLU's own fill on a 12 x 2 x 2 TET10 beam: 0.3 nnz(A) n^(1/3)
    entries of LU_BYTES bounds the factors' entries (8 bytes of value, 4 of index) from above,
    within a factor of 3."""
    K, f, fixed, B, _ = _beam((12, 2, 2))
    free = np.setdiff1d(np.arange(K.shape[0]), fixed)
    A = K[free][:, free]
    lu = fem.symmetric_lu(A)
    factors = 12 * (lu.L.nnz + lu.U.nnz)
    assert factors < fem.direct_memory(A) < 3 * fem.LU_BYTES / 12 * factors


WALL, TIP = Material("wall"), Material("tip")


def test_the_summary_carries_the_true_residual_and_the_fallback(monkeypatch):
    """simulate on a given TET10 box mesh, AMG-CG allowed 2 iterations: the summary names the
    solvers used, why, and the final solution's true residual."""
    scene = flatten(intersection(box(5.5, 0.5, 0.5).translate(5.0, 0, 0).material(Material("beam")),
                                 plane((-1, 0, 0), 0.0).material(WALL), plane((1, 0, 0), 10.0).material(TIP)))
    study = Elasticity(E=1000.0, nu=0.3, fixed={"wall": None}, traction={"tip": (0.0, 0.0, -1.0)})
    mesh = box_mesh((12, 2, 2), (0, -0.5, -0.5), (10.0, 0.5, 0.5), order=2)
    s = simulate(scene, study, mesh=mesh, solver="amg").summary()
    assert s["solver"] == "amg" and s["iterations"] > 0 and s["residual"] < 1e-8
    assert s.get("solver_note", "AMG-CG reached the rounding floor").startswith("AMG-CG reached the rounding floor")
    monkeypatch.setattr(fem, "AMG_MAXITER", 2)
    s = simulate(scene, study, mesh=mesh, solver="amg").summary()
    assert s["solver"] == "amg → direct" and s["iterations"] == 2
    assert s["solver_note"].startswith("AMG-CG reached its 2-iteration limit")
    assert isinstance(s["residual"], float) and 0 < s["residual"] < 1e-9
