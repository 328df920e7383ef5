"""The solvers' checks before heavy work (resolution and its memory, study values, the study's
materials against the scene), their error lines, quiet meshio reads, atomic output files, and the
JAX walker's CPU compiler options on a jaxlib that does not know them. Checks meant to come before
meshing are tested with the meshing replaced by a function that fails the test if called."""
import re
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("skimage")
pytest.importorskip("trimesh")
pytest.importorskip("meshio")

from taperay.runtime import resources  # noqa: E402
from taperay.runtime.tape import TaperayError  # noqa: E402
from taperay.scenegraph import Material, box, difference, flatten, sphere, union  # noqa: E402
from taperay.solvers import (MIN_RESOLUTION, Elasticity, Heat, TetMesh, box_mesh, check_resolution,  # noqa: E402
                             check_study, mesh_surface, resolution_memory, simulate, study_from)
from taperay.solvers import distributed, fem, study as study_module, surface, tetmesh  # noqa: E402

STEEL, TIP = Material("steel", (0.5, 0.5, 0.5)), Material("tip", (0.8, 0.2, 0.2))


def _bar():
    """A bar of steel with a tip of its own material at x = 1."""
    return flatten(union(box(1.0, 0.2, 0.2).material(STEEL), box(0.05, 0.2, 0.2).material(TIP).translate(1.0, 0, 0)))


@pytest.fixture
def no_meshing(monkeypatch):
    """Every way to a surface or tetrahedra fails the test."""
    def forbidden(*args, **kwargs):
        pytest.fail("meshing started before the check")
    for module, name in ((surface, "sample_grid"), (surface, "dual_contour"), (tetmesh, "mesh_part"),
                         (study_module, "mesh_part"), (tetmesh, "tet_mesh")):
        monkeypatch.setattr(module, name, forbidden)


@pytest.fixture
def quiet(capfd):
    """Asserts, after the test, that nothing was printed (file descriptors included) and no warning raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    assert not caught, [str(w.message) for w in caught]


# ---------------------------------------------------------------- resolution

@pytest.mark.parametrize("value,message", [(0, "at least 4"), (3, "at least 4"), (-96, "at least 4"),
                                           (2.5, "whole number"), ("96", "whole number"), (None, "whole number")])
def test_a_resolution_below_the_minimum_or_not_whole_is_refused(value, message, no_meshing):
    with pytest.raises(TaperayError, match=rf"^resolution {re.escape(repr(value))}: .*{message}"):
        check_resolution(value)
    with pytest.raises(TaperayError, match=message):
        mesh_surface(_bar(), value)
    with pytest.raises(TaperayError, match=message):
        simulate(_bar(), Heat(fixed_temperature={"tip": 1.0}), resolution=value)


def test_whole_numbers_pass_and_come_back_as_int():
    assert check_resolution(MIN_RESOLUTION) == MIN_RESOLUTION
    assert check_resolution(np.int64(48)) == 48 and check_resolution(48.0) == 48
    assert isinstance(check_resolution(48.0), int)


def test_a_huge_resolution_is_refused_with_the_largest_that_fits(no_meshing, quiet, monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 8 << 30)
    tape = _bar()
    expected = (r"^--resolution 5000: the grid and the surface need about [\d.]+ [GT]B of memory \(an estimate\), "
                r"and 8\.59 GB is available; use --resolution (\d+) or less$")
    with pytest.raises(TaperayError, match=expected) as e:
        check_resolution(5000, tape, what="--resolution")
    best = int(str(e.value).rsplit("--resolution ", 1)[1].split()[0])
    assert check_resolution(best, tape) == best                    # the advice is the largest that fits
    with pytest.raises(TaperayError, match="is available"):
        check_resolution(best + 1, tape)
    assert resolution_memory(best, tape) <= 8 << 30 < resolution_memory(best + 1, tape)
    with pytest.raises(TaperayError, match="^resolution 5000: the grid and the surface need"):
        mesh_surface(tape, 5000, method="dc")
    with pytest.raises(TaperayError, match="^resolution 5000: the grid, the tetrahedra and the FEM system need"):
        simulate(tape, Heat(fixed_temperature={"tip": 1.0}), resolution=5000)


def test_a_simulation_counts_the_tetrahedra_and_the_fem_system(no_meshing, monkeypatch):
    """A resolution whose grid fits but whose TET10 elasticity system does not is refused by
    simulate (and by check_resolution given the study), not by mesh_surface's check."""
    tape = _bar()
    study = Elasticity(fixed={"steel": None}, traction={"tip": (0, 0, -1.0)})
    surface_need = resolution_memory(200, tape, "mc")
    fem_need = resolution_memory(200, tape, "mc", order=2, components=3)
    assert fem_need > 10 * surface_need
    assert resolution_memory(200, tape, "mc", order=1, components=1) < fem_need
    monkeypatch.setattr(resources, "available_memory", lambda: 2 * surface_need)
    check_resolution(200, tape)
    with pytest.raises(TaperayError, match="the tetrahedra and the FEM system need"):
        check_resolution(200, tape, study=study)
    with pytest.raises(TaperayError, match="the tetrahedra and the FEM system need"):
        simulate(tape, study, resolution=200)


def test_the_petsc_pipeline_checks_the_resolution_before_meshing(no_meshing, monkeypatch):
    pytest.importorskip("mpi4py")
    monkeypatch.setattr(resources, "available_memory", lambda: 1 << 20)
    with pytest.raises(TaperayError, match="^resolution 48: the grid, the tetrahedra and the FEM system need"):
        distributed.simulate_petsc(_bar(), Heat(fixed_temperature={"tip": 1.0}), resolution=48)


@pytest.mark.parametrize("method", ["mc", "dc"])
def test_the_surface_estimate_bounds_what_numpy_allocates(method):
    """The estimate is honest: numpy's peak allocation (tracemalloc; the process's resident peak
    adds the walker's buffers and the allocator's slack) while a sphere is meshed lies between a
    quarter of the estimate and the estimate (measured: 0.37 and 0.44)."""
    tape = flatten(sphere(1.0))
    mesh_surface(tape, 8, method=method)                           # (compiles the twin's kernels)
    tracemalloc.start()
    try:
        mesh_surface(tape, 64, method=method)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    need = resolution_memory(64, tape, method)
    assert 0.25 * need < peak < need, (peak, need)


def test_an_unknown_surface_method_is_refused_before_meshing(no_meshing):
    with pytest.raises(TaperayError, match="unknown surface method 'fast'"):
        check_resolution(48, method="fast")
    with pytest.raises(TaperayError, match="unknown surface method 'fast'"):
        simulate(_bar(), Heat(fixed_temperature={"tip": 1.0}), resolution=48, surface="fast")
    with pytest.raises(TaperayError, match="unknown solver method 'fast'"):
        simulate(_bar(), Heat(fixed_temperature={"tip": 1.0}), resolution=48, solver="fast")


# ---------------------------------------------------------------- study values

EL = {"type": "elasticity", "fixed": {"steel": None}}
HEAT = {"type": "heat", "fixed_temperature": {"tip": 1.0}}
BAD_STUDIES = [
    ({**EL, "nu": 0.7}, r"^Elasticity nu = 0\.7: Poisson's ratio must lie in -1 < nu < 0\.5"),
    ({**EL, "nu": 0.5}, r"^Elasticity nu = 0\.5: Poisson's ratio"),
    ({**EL, "nu": -1.0}, r"^Elasticity nu = -1\.0: Poisson's ratio"),
    ({**EL, "nu": {"steel": 0.3, "tip": 0.6}}, r"^Elasticity nu\['tip'\] = 0\.6"),
    ({**EL, "E": -2e9}, r"^Elasticity E = -2000000000\.0: Young's modulus must be > 0"),
    ({**EL, "E": 0}, r"^Elasticity E = 0: Young's modulus must be > 0"),
    ({**EL, "E": float("nan")}, r"^Elasticity E = nan: must be a finite number"),
    ({**EL, "E": "70e9"}, r"^Elasticity E = '70e9': must be a number"),
    ({**EL, "traction": {"tip": 5.0}}, r"^Elasticity traction\['tip'\] = 5\.0: must be three numbers"),
    ({**EL, "traction": {"tip": (0, 0, 1, 2)}}, r"^Elasticity traction\['tip'\] = \(0, 0, 1, 2\): must be three"),
    ({**EL, "traction": {"tip": (0, float("inf"), 1)}}, r"^Elasticity traction\['tip'\] = inf: must be a finite"),
    ({**EL, "fixed": {"steel": (None, None, None)}}, r"^Elasticity fixed\['steel'\] = .*fixes no component"),
    ({**EL, "body_force": (0, -9.8)}, r"^Elasticity body_force = .*three numbers"),
    ({**EL, "free_body": "yes"}, r"^Elasticity free_body = 'yes'"),
    ({**HEAT, "conductivity": -1}, r"^Heat conductivity = -1: the conductivity must be > 0"),
    ({**HEAT, "conductivity": {"steel": 0.0, "*": 1.0}}, r"^Heat conductivity\['steel'\] = 0\.0: the conductivity"),
    ({"type": "heat", "convection": {"steel": (-5.0, 20.0)}},
     r"^Heat convection\['steel'\] = \(-5\.0, 20\.0\): the coefficient h must be >= 0"),
    ({"type": "heat", "convection": {"steel": 5.0}}, r"^Heat convection\['steel'\] = 5\.0: must be \(h, T_inf\)"),
    ({"type": "heat", "fixed_temperature": {"tip": float("nan")}}, r"^Heat fixed_temperature\['tip'\] = nan: must be"),
    ({"type": "heat", "fixed_temperature": ["tip"]}, r"^Heat fixed_temperature = \['tip'\]: must be a dict"),
    ({**HEAT, "heat_flux": {3: 1.0}}, r"^Heat heat_flux: the key 3 is not a material name"),
]


@pytest.mark.parametrize("spec,message", BAD_STUDIES,
                         ids=[m.split(":")[0].lstrip("^").replace("\\", "") for _, m in BAD_STUDIES])
def test_a_bad_study_value_is_one_error_naming_field_and_value(spec, message, no_meshing, quiet):
    with pytest.raises(TaperayError, match=message):
        study_from(spec)
    with pytest.raises(TaperayError, match=message):
        simulate(_bar(), spec, resolution=16)
    cls = Heat if spec["type"] == "heat" else Elasticity
    with pytest.raises(TaperayError, match=message):
        cls(**{k: v for k, v in spec.items() if k != "type"})


def test_a_study_changed_after_it_was_made_is_checked_again(no_meshing):
    study = Elasticity(fixed={"steel": None})
    study.nu = 0.7
    with pytest.raises(TaperayError, match="Poisson's ratio"):
        simulate(_bar(), study, resolution=16)


def test_good_studies_pass():
    assert check_study(_bar(), {"type": "elasticity", "E": {"steel": 2e11, "*": 7e10}, "nu": -0.5,
                                "fixed": {"steel": (0, None, None), "tip": True}, "body_force": np.zeros(3)})
    assert check_study(_bar(), Heat(conductivity={"steel": 50}, convection={"steel": (0.0, 20), "tip": (5, 20)}))


# ---------------------------------------------------------------- the study against the scene

def test_a_missing_material_is_refused_before_meshing_with_the_scene_names(no_meshing, quiet):
    study = Heat(fixed_temperature={"lid": 1.0}, convection={"steel": (5.0, 20.0), "fins": (1.0, 20.0)})
    expected = (r"^the study's fixed_temperature: the scene has no material named 'lid'; the study's convection: "
                r"the scene has no material named 'fins' \(its materials: default, steel, tip\)$")
    with pytest.raises(TaperayError, match=expected):
        check_study(_bar(), study)
    with pytest.raises(TaperayError, match=expected):
        simulate(_bar(), study, resolution=16)
    with pytest.raises(TaperayError, match=expected):
        distributed.simulate_petsc(_bar(), study, resolution=16)
    with pytest.raises(TaperayError, match=r"the study's E: the scene has no material named 'stell'"):
        check_study(_bar(), Elasticity(E={"stell": 1.0, "*": 2.0}, fixed={"steel": None}))


@pytest.mark.parametrize("study,message", [
    (Heat(heat_flux={"tip": 1.0}), "no fixed_temperature and no convection with h > 0"),
    (Heat(convection={"tip": (0.0, 20.0)}), "no fixed_temperature and no convection with h > 0"),
    (Elasticity(traction={"tip": (0, 0, 1.0)}), "no fixed support; the part would float"),
    (Elasticity(fixed={"steel": None}, free_body=True), "free_body=True means no supports"),
])
def test_a_study_that_cannot_have_a_solution_is_refused_before_meshing(study, message, no_meshing):
    with pytest.raises(TaperayError, match=message):
        simulate(_bar(), study, resolution=16)


def test_a_singular_system_is_one_error_without_warnings(quiet):
    """solve_linear on a heat system with nothing fixed (singular): spsolve's and pyamg's warnings
    are held back; the error says what failed."""
    mesh = box_mesh((3, 3, 3))
    K, f = fem.heat_system(mesh.nodes, mesh.elements, 1.0, 1.0)
    for method in ("direct", "amg"):
        with pytest.raises(TaperayError, match=f"the linear solve failed \\({method}"):
            fem.solve_linear(K, f, method=method)


# ---------------------------------------------------------------- error lines that explain themselves

def test_an_empty_scene_says_so(quiet):
    empty = flatten(difference(sphere(1.0), sphere(2.0)))
    for method in ("mc", "dc"):
        expected = (r"^nothing to mesh: the part has no inside on the grid \(all [\d,]+ points sampled at "
                    r"resolution 8, spacing 0\.\d+, lie outside it\); the scene is empty .* or thinner than a grid "
                    r"cell \(raise the resolution\)$")
        with pytest.raises(TaperayError, match=expected):
            mesh_surface(empty, 8, method=method)


def test_a_load_on_a_material_with_no_boundary_face_names_the_load_and_material():
    """The tip here is a box inside the steel: it carries no boundary face of the mesh."""
    tape = flatten(union(box(0.5, 0.5, 0.5).material(STEEL).translate(0.5, 0.5, 0.5),
                         box(0.1, 0.1, 0.1).material(TIP).translate(0.5, 0.5, 0.5)))
    mesh = box_mesh((4, 4, 4))
    check_study(tape, Elasticity(fixed={"steel": None}, traction={"tip": (0, 0, 1)}))      # (the scene has a tip)
    with pytest.raises(TaperayError, match=r"^the study's traction on material 'tip': no boundary face of the mesh "
                                           r"carries that material; is that part inside another"):
        simulate(tape, Elasticity(fixed={"steel": None}, traction={"tip": (0, 0, 1)}), mesh=mesh)


def test_a_part_too_thin_for_the_grid_is_refused_with_the_resolution_to_try():
    """A foil 2e-5 thick beside a block, meshed at resolution 16 (cells of about 0.2): no face
    carries the foil's material, and the error names the resolution and one twice as fine."""
    foil = Material("foil", (0.9, 0.7, 0.2))
    tape = flatten(union(box(1, 1, 1).material(STEEL), box(1e-5, 1, 1).translate(1.5, 0, 0).material(foil)))
    with pytest.raises(TaperayError, match=r"^the study's fixed_temperature on material 'foil': no boundary face .* "
                                           r"thinner than a grid cell at resolution 16 \(raise the resolution, e\.g\. "
                                           r"to 32\)\?$"):
        simulate(tape, Heat(conductivity=1.0, fixed_temperature={"foil": 1.0, "steel": 0.0}), resolution=16)


# ---------------------------------------------------------------- mesh files

@pytest.mark.parametrize("name,content,reason", [
    ("bad.vtu", b"garbage", r"Couldn't read file .*bad\.vtu as vtu"),
    ("empty.vtu", b"", r"Couldn't read file .*empty\.vtu as vtu"),
    ("bad.msh", b"garbage", r"Couldn't read file .*bad\.msh as either of ansys, gmsh"),
    ("bad.qqq", b"garbage", r"Could not deduce file format"),
    ("absent.vtu", None, r"File .*absent\.vtu not found"),
])
def test_a_bad_mesh_file_is_one_quiet_error(tmp_path, name, content, reason, quiet):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TaperayError, match=rf"^{path}: not a tetrahedral mesh meshio can read \({reason}"):
        TetMesh.load(path)


def test_a_mesh_of_other_cells_is_refused(tmp_path):
    import meshio
    meshio.write(tmp_path / "tri.vtu", meshio.Mesh(np.eye(3), [("triangle", np.array([[0, 1, 2]]))]))
    with pytest.raises(TaperayError, match="needs tetra or tetra10 cells"):
        TetMesh.load(tmp_path / "tri.vtu")


def _no_temporaries(folder: Path, keep: set):
    assert {p.name for p in folder.iterdir()} == keep


def test_mesh_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    import meshio
    mesh = box_mesh((2, 2, 2), order=2)
    target = tmp_path / "mesh.vtu"
    mesh.save(target)
    back = TetMesh.load(target)
    assert np.allclose(back.nodes, mesh.nodes) and np.array_equal(back.elements, mesh.elements)
    before = target.read_bytes()

    def broken(path, *args, **kwargs):
        Path(path).write_bytes(b"half a mesh")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(meshio, "write", broken)
    with pytest.raises(TaperayError, match=rf"^{target}: cannot write: No space left on device"):
        mesh.save(target)
    assert target.read_bytes() == before
    _no_temporaries(tmp_path, {"mesh.vtu"})
    monkeypatch.undo()
    with pytest.raises(TaperayError, match=r"mesh\.qqq: meshio knows no mesh format with the suffix '\.qqq'$"):
        mesh.save(tmp_path / "mesh.qqq")
    _no_temporaries(tmp_path, {"mesh.vtu"})


def test_result_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    import meshio
    from matplotlib.figure import Figure
    tape = flatten(box(0.5, 0.5, 0.5).material(STEEL).translate(0.5, 0.5, 0.5))
    res = simulate(tape, Heat(source=1.0, fixed_temperature={"steel": 0.0}), mesh=box_mesh((3, 3, 3)))
    vtu, png = tmp_path / "r.vtu", tmp_path / "cut.png"
    vtu.write_bytes(b"old result")
    png.write_bytes(b"old picture")

    def broken(path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(meshio, "write", broken)
    monkeypatch.setattr(Figure, "savefig", lambda self, path, *args, **kwargs: broken(path))
    with pytest.raises(TaperayError, match=rf"^{vtu}: cannot write: Input/output error"):
        res.save_vtu(vtu)
    with pytest.raises(TaperayError, match=rf"^{png}: cannot write: Input/output error"):
        res.save_section(png)
    assert vtu.read_bytes() == b"old result" and png.read_bytes() == b"old picture"
    _no_temporaries(tmp_path, {"r.vtu", "cut.png"})
    monkeypatch.undo()
    res.save_vtu(vtu)
    res.save_section(png)
    assert "temperature" in meshio.read(vtu).point_data and png.read_bytes()[:4] == b"\x89PNG"
    _no_temporaries(tmp_path, {"r.vtu", "cut.png"})


def test_surface_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    import trimesh
    surf = mesh_surface(flatten(sphere(1.0)), 8)
    target = tmp_path / "part.stl"
    surf.save(target)
    assert len(trimesh.load(target).faces) == len(surf.faces)
    before = target.read_bytes()
    with pytest.raises(TaperayError, match=rf"^{tmp_path / 'part.qqq'}: trimesh cannot write a surface mesh as qqq"):
        surf.save(tmp_path / "part.qqq")

    def broken(self, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(trimesh.Trimesh, "export", broken)
    with pytest.raises(TaperayError, match=rf"^{target}: cannot write: No space left on device"):
        surf.save(target)
    assert target.read_bytes() == before
    _no_temporaries(tmp_path, {"part.stl"})


# ---------------------------------------------------------------- the JAX walker's compiler options

def test_the_jax_walker_runs_where_jaxlib_does_not_know_its_cpu_options(monkeypatch):
    """jax 0.11's CPU compiler has no ``xla_cpu_use_fusion_emitters``: an option this jaxlib does
    not know stands in for it. The walker notices once and compiles without it."""
    jw = pytest.importorskip("taperay.runtime.jax_walker")
    import jax
    if jax.default_backend() != "cpu":
        pytest.skip("the options are the CPU's")
    from taperay.runtime.cpu import CpuWalker
    monkeypatch.setattr(jw, "CPU_COMPILER_OPTIONS", {"xla_cpu_no_such_option_in_any_jaxlib": False})
    jw.cpu_options_accepted.cache_clear()
    try:
        tape = flatten(sphere(0.75).translate(0.1, 0, 0))
        pts = np.random.default_rng(3).uniform(-1, 1, (50, 3)).astype(np.float32)
        d, m = jw.JaxWalker(cache=False).evaluate(tape, pts)
        assert np.allclose(d, CpuWalker().evaluate(tape, pts)[0], atol=1e-5)
        assert jw.cpu_options_accepted() is False and jw.compiler_options() is None
    finally:
        jw.cpu_options_accepted.cache_clear()
