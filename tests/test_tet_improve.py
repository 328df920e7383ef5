"""solvers/tet_improve.py: the mesh improvement pass after TetGen. Each operation on a small
hand-made configuration, then the whole pass on TetGen's meshes of dual-contoured surfaces: no
element below the bound, every element positively oriented, the volume, the boundary faces and
their nodes unchanged, materials as they were."""
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tetgen")

from taperay.scenegraph import Material, difference, flatten, sphere, union  # noqa: E402
from taperay.scenegraph.loading import load_tape  # noqa: E402
from taperay.solvers import mesh_surface, tet_mesh  # noqa: E402
from taperay.solvers.study import element_materials  # noqa: E402
from taperay.solvers.tet_improve import MeshRegion, improve_mesh, min_sine, quality  # noqa: E402
from taperay.solvers.tetmesh import TetMesh, box_mesh, boundary_faces, dihedral_angles, orient  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TARGET = math.sin(math.radians(10.0))


def _volumes(nodes, elements):
    return TetMesh(np.asarray(nodes, float), np.asarray(elements)).volumes()


def _face_set(nodes, elements):
    """The boundary faces as sets of corner coordinates (node numbers may change)."""
    return {frozenset(map(tuple, nodes[f].round(15))) for f in boundary_faces(elements)}


def _region(nodes, elements, free=()):
    return MeshRegion(np.asarray(nodes, float), np.asarray(elements), set(free), len(nodes), TARGET)


def _arrays(region):
    el = np.array(list(region.tets.values()))
    nodes = np.zeros((max(region.x) + 1, 3))
    for v, p in region.x.items():
        nodes[v] = p
    return nodes, el


def _ring(height):
    """Three tetrahedra around the edge (3, 4) from (0, 0, -height) to (0, 0, height), a unit
    triangle (0, 1, 2) around it; and the two tetrahedra on that triangle."""
    nodes = np.array([(math.cos(2 * math.pi * i / 3), math.sin(2 * math.pi * i / 3), 0.0) for i in range(3)]
                     + [(0, 0, -height), (0, 0, height)])
    three = orient(nodes, np.array([[3, 4, 0, 1], [3, 4, 1, 2], [3, 4, 2, 0]]))
    two = orient(nodes, np.array([[0, 1, 2, 3], [0, 1, 2, 4]]))
    return nodes, three, two


def _check_same_region(nodes0, el0, nodes1, el1):
    assert np.all(_volumes(nodes1, el1) > 0)
    assert _volumes(nodes1, el1).sum() == pytest.approx(_volumes(nodes0, el0).sum(), rel=1e-12)
    assert _face_set(nodes1, el1) == _face_set(nodes0, el0)


def test_quality_is_the_smallest_sine_of_the_dihedral_angles():
    rng = np.random.default_rng(3)
    nodes = rng.normal(size=(200, 3))
    el = orient(nodes, np.stack([rng.permutation(200)[:4] for _ in range(100)]))
    expected = np.sin(np.radians(dihedral_angles(nodes, el))).min(1)
    assert np.allclose(min_sine(nodes, el), expected, atol=1e-12)
    assert np.allclose([quality(*map(tuple, nodes[t])) for t in el], expected, atol=1e-12)
    assert quality(*map(tuple, nodes[el[0][[0, 2, 1, 3]]])) == -1.0      # inverted


def test_edge_removal_of_three_tetrahedra_is_the_3_2_flip():
    nodes, three, _ = _ring(2.0)                          # a long edge: three needles
    region = _region(nodes, three)
    assert sorted(region.ring(3, 4)) == [0, 1, 2]
    new = region.remove_edge(3, 4)
    assert new is not None and len(region.tets) == 2
    n1, e1 = _arrays(region)
    assert min_sine(n1, e1).min() > min_sine(nodes, three).min() + 0.3
    assert not (region.star[3] & region.star[4])          # the edge is gone
    _check_same_region(nodes, three, n1, e1)


def test_the_2_3_flip_and_an_edge_on_the_boundary():
    nodes, _, two = _ring(0.3)                            # a short edge would be better: two caps
    region = _region(nodes, two)
    assert region.ring(0, 1) is None and region.remove_edge(0, 1) is None    # on a boundary face
    k = next(iter(region.tets))
    new = region.flip23(k, (0, 1, 2))
    assert new is not None and len(region.tets) == 3
    n1, e1 = _arrays(region)
    assert min_sine(n1, e1).min() > min_sine(nodes, two).min() + 0.3
    _check_same_region(nodes, two, n1, e1)
    assert region.flip23(new[0], tuple(v for v in region.tets[new[0]] if v != 3)) is None   # a face of the hull


def test_smoothing_moves_an_interior_node_up_and_nothing_else():
    mesh = box_mesh((2, 2, 2))
    centre = int(np.argmin(np.linalg.norm(mesh.nodes - 0.5, axis=1)))
    nodes = mesh.nodes.copy()
    nodes[centre] = (0.93, 0.9, 0.88)                    # near a corner of its star: slivers
    region = _region(nodes, mesh.elements, free=[centre])
    before = min_sine(nodes, mesh.elements).min()
    assert region.smooth(centre)
    n1, e1 = _arrays(region)
    assert np.array_equal(e1, mesh.elements)              # no topology change
    assert np.array_equal(np.delete(n1, centre, 0), np.delete(nodes, centre, 0))
    assert min_sine(n1, e1).min() > before + 0.2
    _check_same_region(nodes, mesh.elements, n1, e1)


def test_contraction_removes_an_interior_node_next_to_another():
    mesh = box_mesh((2, 2, 2))
    centre = int(np.argmin(np.linalg.norm(mesh.nodes - 0.5, axis=1)))
    t = int(np.flatnonzero((mesh.elements == centre).any(1))[0])
    extra = len(mesh.nodes)                               # a node 1e-3 off the centre, in one of its tets
    nodes = np.concatenate([mesh.nodes, [0.999 * mesh.nodes[centre] + 0.001 * mesh.nodes[mesh.elements[t]].mean(0)]])
    a, b, c, d = mesh.elements[t]
    el = orient(nodes, np.concatenate([np.delete(mesh.elements, t, 0),
                                       [[extra, b, c, d], [a, extra, c, d], [a, b, extra, d], [a, b, c, extra]]]))
    region = _region(nodes, el, free=[centre, extra])
    new = region.contract(extra)
    assert new is not None and extra not in region.star
    n1, e1 = _arrays(region)
    assert min_sine(n1, e1).min() > 0.5 > min_sine(nodes, el).min()
    _check_same_region(nodes, el, n1, e1)


def test_insertion_replaces_a_cap_under_a_shallow_roof():
    """A cap (0, 1, 2, 3) with two boundary faces meeting at 169 degrees on the ridge (0, 1), over
    two tetrahedra to the apex 4: a new interior node, smoothed, gives six good tetrahedra."""
    nodes = np.array([(0, -1, 0), (0, 1, 0), (-1, 0, -0.1), (1, 0, -0.1), (0, 0, -1.5)], float)
    el = orient(nodes, np.array([[0, 1, 2, 3], [0, 2, 3, 4], [1, 2, 3, 4]]))
    region = _region(nodes, el)
    new = region.insert(0)
    assert new is not None and len(new) == 6 and region.new_points == [5]
    n1, e1 = _arrays(region)
    assert min_sine(n1, e1).min() > 0.5 > min_sine(nodes, el).min()
    _check_same_region(nodes, el, n1, e1)
    assert np.array_equal(n1[:5], nodes)


def _hollow_sphere():
    outer, inner = Material("outer", (0.8, 0.3, 0.2)), Material("inner", (0.2, 0.3, 0.8))
    return flatten(union(difference(sphere(1.0).material(outer), sphere(0.415)),
                         difference(sphere(0.43).material(inner), sphere(0.4))))


def _material_volumes(tape, nodes, elements) -> dict:
    """Volume per material, each element carrying the tape's material at its centroid."""
    mat, vol = element_materials(tape, nodes, elements), _volumes(nodes, elements)
    return {int(m): float(vol[mat == m].sum()) for m in np.unique(mat)}


# TetGen's raw meshes differ by machine (the surface's last bits follow the CPU's vector paths):
# the hollow sphere 1.99 degrees and 6 elements below 5 on an AMD EPYC, 1.28 and 13 on an Intel
# Xeon; the machined part 0.072 degrees and 146 / 141 below 5 (thin boundary triangles)
@pytest.mark.parametrize("scene, resolution, bound, slivers_at_least", [
    ("hollow sphere", 16, 10.0, 3),
    ("machined_part", 32, None, 100)])
def test_the_pass_on_tetgen_meshes_of_dual_contoured_surfaces(scene, resolution, bound, slivers_at_least):
    tape = _hollow_sphere() if scene == "hollow sphere" else load_tape(ROOT / "scenes" / "machined_part.py")
    surf = mesh_surface(tape, resolution, method="dc")
    raw = tet_mesh(surf, keep_boundary=True, improve=False)
    before = dihedral_angles(raw.nodes, raw.elements).min(1)
    below_5_before = np.count_nonzero(before < 5)
    assert below_5_before >= slivers_at_least           # (the pass has slivers to mend)
    fixed = np.zeros(len(raw.nodes), bool)
    fixed[boundary_faces(raw.elements)] = True
    nodes, el, stats = improve_mesh(raw.nodes, raw.elements, fixed)
    after = dihedral_angles(nodes, el).min(1)
    if bound is not None:
        assert after.min() >= bound
    else:     # the slivers on thin triangles of the surface stay: at most a quarter (measured: 32 of 146)
        assert np.count_nonzero(after < 5) <= 0.25 * below_5_before and after.min() > before.min()
    _check_same_region(raw.nodes, raw.elements, nodes, el)
    assert np.array_equal(nodes[:len(surf.vertices)], raw.nodes[:len(surf.vertices)])   # the surface's vertices
    # the faces are the same, so their materials are; an element's material is the tape's at its
    # centroid: elements re-cut near a material interface move volume between materials, little
    was, now = _material_volumes(tape, raw.nodes, raw.elements), _material_volumes(tape, nodes, el)
    assert was.keys() == now.keys()
    assert all(abs(now[m] - was[m]) < 1e-3 * sum(was.values()) for m in was)
    assert sum(stats["operations"].values()) > 0 and stats["seconds"] < 60


def test_tet_mesh_improves_by_default():
    surf = mesh_surface(_hollow_sphere(), 16, method="dc")
    mesh = tet_mesh(surf, order=2, keep_boundary=True)
    assert mesh.stats["improvement"]["operations"]
    assert dihedral_angles(mesh.nodes, mesh.elements).min() >= 10.0
    assert tet_mesh(surf, keep_boundary=True, improve=False).stats["improvement"] is None
