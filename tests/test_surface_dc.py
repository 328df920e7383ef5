"""Dual contouring (solvers.dual_contour, ``mesh_surface(method="dc")``): watertight, manifold,
outward-oriented surfaces; volumes at the default resolution; sharp box edges and corners kept; the
band evaluates less than the whole grid; ambiguous faces crossed twice stay manifold; caps and
folds mended (on a hand-made cube and where a part's feature lines run along the grid); TetGen fills
the result."""
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trimesh")

from taperay.runtime.tape import TaperayError  # noqa: E402
from taperay.scenegraph import box, difference, flatten, sphere, union  # noqa: E402
from taperay.solvers import mesh_surface  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENES = sorted(p.stem for p in (ROOT / "scenes").glob("*.py") if not p.stem.startswith("_"))
SLOW_SCENES = {"bolt_bin", "menger_sponge", "strut_lattice"}     # 10+ s each on 2 cores


def dc(node, resolution=96):
    return mesh_surface(flatten(node), resolution, method="dc")


def assert_closed_manifold(s):
    """Every undirected edge in exactly two triangles, every directed edge in exactly one
    (consistent winding), no repeated vertex in a triangle, every vertex used, positive volume."""
    f = s.faces
    assert len(f) and (f[:, 0] != f[:, 1]).all() and (f[:, 1] != f[:, 2]).all() and (f[:, 2] != f[:, 0]).all()
    directed = f[:, [0, 1, 1, 2, 2, 0]].reshape(-1, 2)
    _, undirected_count = np.unique(np.sort(directed, 1), axis=0, return_counts=True)
    _, directed_count = np.unique(directed, axis=0, return_counts=True)
    assert (undirected_count == 2).all(), np.bincount(undirected_count)
    assert (directed_count == 1).all()
    assert np.array_equal(np.unique(f), np.arange(len(s.vertices)))
    assert s.is_watertight and s.volume > 0


def box_distance(p, half):
    q = np.abs(p) - half
    return np.linalg.norm(np.maximum(q, 0), axis=1) + np.minimum(q.max(1), 0)


def test_sphere_is_closed_manifold_outward_with_volume_and_area_within_half_a_percent():
    s = dc(sphere(1.0))
    assert_closed_manifold(s)
    assert abs(s.volume / (4 / 3 * np.pi) - 1) < 0.005
    assert abs(s.area / (4 * np.pi) - 1) < 0.005
    centroids = s.vertices[s.faces].mean(1)
    normals = np.cross(*(s.vertices[s.faces[:, i]] - s.vertices[s.faces[:, 0]] for i in (1, 2)))
    assert (np.einsum("ij,ij->i", normals, centroids) > 0).all()          # every triangle faces out
    h = s.stats["spacing"]
    err = np.abs(np.linalg.norm(s.vertices, axis=1) - 1)
    assert err.max() < 0.05 * h                                           # QEF points: O(h^2) off
    assert s.stats["max_vertex_distance"] == pytest.approx(err.max(), rel=0.01, abs=1e-6)


def test_box_keeps_its_faces_edges_and_corners():
    half = np.array([1.0, 0.6, 0.4])
    s = dc(box(*half).translate(0.013, -0.007, 0.004))      # faces off the grid planes
    assert_closed_manifold(s)
    v = s.vertices - [0.013, -0.007, 0.004]
    assert abs(s.volume / np.prod(2 * half) - 1) < 1e-5
    dist = np.abs(box_distance(v, half))
    assert dist.max() < 1e-5 * 2 * half.max()              # every vertex on the box surface
    assert s.stats["max_vertex_distance"] < 1e-5
    h = s.stats["spacing"]
    corners = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)]) * half
    assert np.linalg.norm(v[None] - corners[:, None], axis=2).min(1).max() < 1e-5   # all 8 corners are vertices
    for axis in range(3):                                  # the 12 edges: a vertex on them in every cell they cross
        others = [a for a in range(3) if a != axis]
        for sa in (-1, 1):
            for sb in (-1, 1):
                on = (np.abs(v[:, others[0]] - sa * half[others[0]]) < 1e-5) & \
                     (np.abs(v[:, others[1]] - sb * half[others[1]]) < 1e-5)
                t = np.sort(v[on, axis])
                assert t[0] == pytest.approx(-half[axis], abs=1e-5) and t[-1] == pytest.approx(half[axis], abs=1e-5)
                assert np.diff(t).max() < 2 * h


def test_marching_cubes_cuts_the_corners_dual_contouring_keeps():
    half = np.array([1.0, 0.6, 0.4])
    corners = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)]) * half
    tape = flatten(box(*half).translate(0.013, -0.007, 0.004))
    gap = {m: np.linalg.norm((mesh_surface(tape, 48, method=m).vertices - [0.013, -0.007, 0.004])[None]
                             - corners[:, None], axis=2).min(1).max() for m in ("mc", "dc")}
    h = 2.0 / 48
    assert gap["dc"] < 1e-5 and gap["mc"] > 0.1 * h


@pytest.mark.parametrize("gap_cells", [0.3, 0.7, 1.5])
def test_union_with_a_thin_gap_is_closed_manifold(gap_cells):
    h = 2.0 / 96
    g = gap_cells * h
    s = dc(union(box(0.5, 0.5, 0.5).translate(-0.5 - g / 2, 0, 0), box(0.5, 0.5, 0.5).translate(0.5 + g / 2, 0.1, 0.05)))
    assert_closed_manifold(s)
    assert abs(s.volume / 2.0 - 1) < 0.005
    if gap_cells > 1:                                      # a gap wider than a cell stays open: two shells
        assert len(s.trimesh().split(only_watertight=False)) == 2


def test_a_patch_crossing_an_ambiguous_face_twice_stays_manifold():
    """Two tiny cavities on diagonal nodes of one cell face: the cells on both sides of that face
    have one patch crossing it twice; dual contouring adds a vertex on the face per crossing."""
    probe = dc(box(1, 1, 1), 32)
    h, origin = probe.stats["spacing"], np.array(probe.stats["origin"])
    centre = origin + (np.array(probe.stats["grid"]) // 2) * h
    holes = union(sphere(0.3 * h).translate(*(centre + [h, 0, 0])), sphere(0.3 * h).translate(*(centre + [0, h, 0])))
    s = dc(difference(box(1, 1, 1), holes), 32)
    assert s.stats["grid"] == probe.stats["grid"] and s.stats["origin"] == probe.stats["origin"]
    assert s.stats["face_vertices"] > 0
    assert_closed_manifold(s)


def test_band_evaluates_a_fraction_of_the_grid():
    s = dc(sphere(1.0), 192)
    assert s.stats["evaluated_nodes"] < 0.25 * s.stats["full_grid_nodes"]
    assert abs(s.volume / (4 / 3 * np.pi) - 1) < 0.001


def test_unknown_method_and_empty_scene_are_clear_errors():
    with pytest.raises(TaperayError, match="unknown surface method"):
        mesh_surface(flatten(sphere(1.0)), 16, method="bogus")
    with pytest.raises(TaperayError, match="no inside"):
        mesh_surface(flatten(difference(sphere(1.0), sphere(2.0))), 16, method="dc")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SCENES else n for n in SCENES])
def test_every_scene_gives_a_closed_manifold_surface(name):
    from taperay.scenegraph.loading import load_scene_module
    path = ROOT / "scenes" / f"{name}.py"
    s = mesh_surface(flatten(load_scene_module(path), source=str(path)), method="dc")
    assert_closed_manifold(s)
    assert s.stats["max_vertex_distance"] <= np.sqrt(3) * s.stats["spacing"]   # vertices stay in their cells
    # mending changes a few triangles, not the surface over and over (plate_million_holes' caps
    # along lines of vertices were split round and round: 313,000 changes to 39,000 triangles)
    assert s.stats["unfolds"] + s.stats["cap_splits"] + s.stats["flips"] < 0.05 * len(s.faces)


@pytest.mark.slow
@pytest.mark.parametrize("node, resolution", [(sphere(1.0), 24), (box(1.0, 0.6, 0.4), 24),
                                              (difference(sphere(1.0), sphere(0.5)), 48)],
                         ids=["sphere", "box", "hollow sphere"])
def test_tetgen_fills_a_dual_contoured_surface(node, resolution):
    """The hollow sphere's inner surface runs through grid nodes; the crossings kept off the edges'
    ends give the cells around such a node distinct vertices (no triangle of zero area)."""
    from taperay.solvers import tet_mesh
    s = dc(node, resolution)
    v = s.vertices[s.faces]
    area = 0.5 * np.linalg.norm(np.cross(v[:, 1] - v[:, 0], v[:, 2] - v[:, 0]), axis=1)
    assert area.min() > 1e-12 * s.stats["spacing"] ** 2
    m = tet_mesh(s, repair=False)
    assert np.all(m.volumes() > 0)
    assert m.volumes().sum() == pytest.approx(s.volume, rel=1e-5)


@pytest.mark.slow
def test_bench_surface_reports_both_methods(tmp_path):
    import json
    from types import SimpleNamespace
    from taperay.tools.bench import report
    from taperay.tools.bench_surface import bench_surface
    result = bench_surface(SimpleNamespace(repeat=1, walker="cpu"))
    rows = {(r["surface"], r["method"]): r for r in result.rows}
    assert {m for _, m in rows} == {"dc", "mc"} and len(rows) == 10
    assert all(r["closed manifold"] for r in result.rows if r["method"] == "dc")
    box = "box 2x1.2x0.8 off the grid"
    assert rows[box, "dc"]["corner gap (cells)"] < 1e-3 < rows[box, "mc"]["corner gap (cells)"]
    report("surface", result, tmp_path)
    assert len(json.loads((tmp_path / "surface.json").read_text())["rows"]) == 10


def _cube_with_fan_top():
    """A unit cube's surface, its top a fan of four triangles about an inner point (index 8)."""
    v = np.array([[x, y, z] for z in (0, 1) for y in (0, 1) for x in (0, 1)] + [[0.35, 0.3, 1.0]], float)
    top = [4, 5, 7, 6]                                    # counter-clockwise seen from above
    faces = [[top[i], top[(i + 1) % 4], 8] for i in range(4)]
    for quad in ([0, 2, 3, 1], [0, 1, 5, 4], [1, 3, 7, 5], [3, 2, 6, 7], [2, 0, 4, 6]):
        faces += [[quad[0], quad[1], quad[2]], [quad[0], quad[2], quad[3]]]
    return v, np.array(faces)


def _mended_cube(v, f):
    import trimesh
    from taperay.solvers.surface_cleanup import mend_thin_triangles, triangle_angles
    before = trimesh.Trimesh(v, f, process=False)
    assert_closed_manifold(before)
    faces, done = mend_thin_triangles(v, f)
    after = trimesh.Trimesh(v, faces, process=False)
    assert_closed_manifold(after)
    n = after.face_normals
    shared = after.face_adjacency
    assert (np.einsum("ij,ij->i", n[shared[:, 0]], n[shared[:, 1]]) > -0.99).all()      # no fold left
    assert triangle_angles(v[faces]).max() < 175.0                                      # no cap left
    return before.volume, after.volume, done


def test_mending_unfolds_a_flap_of_no_volume():
    """Two coplanar triangles of the top, one folded back inside the other (as dual contouring
    leaves where a cell's vertex sits inside a part thinner than the cell): the pair becomes the
    larger triangle less the smaller."""
    v, f = _cube_with_fan_top()
    s0, s1, s2, c = 4, 5, 7, 8
    f = np.array([t for t in f.tolist() if t not in ([s0, s1, c], [s1, s2, c])] + [[s0, s2, c], [s2, s0, s1]])
    was, now, done = _mended_cube(v, f)
    assert done["unfolds"] == 1 and was == pytest.approx(1.0, abs=1e-12) and now == pytest.approx(1.0, abs=1e-12)


def test_mending_splits_a_cap_into_its_neighbour():
    """A vertex a millionth of the edge off the cube's top edge, joined to both its ends (a
    T-junction): the front face's triangle across that edge takes the vertex."""
    v, f = _cube_with_fan_top()
    s0, s1, c = 4, 5, 8
    v = np.concatenate([v, [[0.5, 1e-6, 1.0]]])
    p = len(v) - 1
    f = np.array([t for t in f.tolist() if t != [s0, s1, c]] + [[s0, p, c], [p, s1, c], [p, s0, s1]])
    was, now, done = _mended_cube(v, f)
    assert done["cap_splits"] == 1        # (the front face now bends through the vertex: a sliver of volume)
    assert was == pytest.approx(1.0, abs=1e-12) and now == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("resolution", [20, 40])
def test_feature_lines_along_the_grid_leave_no_flat_tetrahedra(resolution):
    """The heat sink's fin roots and plate edges lie on grid lines at these resolutions: the
    vertices there crowd together and fold, which left TetGen's boundary-keeping mesh with
    tetrahedra flat to 0.001 degrees. Mended, no element is below 2 degrees, the volume is the
    exact one, and the surface is the resolution asked for (no fallback)."""
    from taperay.scenegraph.loading import load_tape
    from taperay.solvers.fem import dihedral_angles
    from taperay.solvers.tetmesh import mesh_part
    from taperay.tools.bench_verify import heat_sink_volume
    mesh, stats, _ = mesh_part(load_tape(ROOT / "scenes" / "heat_sink.py"), resolution)
    assert stats["method"] == "dc" and stats["resolution"] == resolution and "fallback" not in stats
    assert stats["volume"] == pytest.approx(heat_sink_volume(0.006, 0.0015, 0.03), rel=1e-4)
    assert dihedral_angles(mesh.nodes, mesh.elements).min() > 2.0
