"""solvers: simulation on tapes. Tape -> watertight surface (``mesh_surface``) -> tetrahedra
(``tet_mesh``, TetGen in a child process) -> steady heat / linear elasticity FEM on TET4 and TET10
(``simulate`` with a ``Heat`` or ``Elasticity`` study whose boundary conditions name materials).
Checks before any work: ``check_study(tape, study)`` and ``check_resolution(resolution, tape, ...)``.

Names load on first use; the optional packages (scikit-image, trimesh, meshio, tetgen, pymeshfix,
pyamg: ``pip install 'taperay[sim]'``) are imported only when needed.
"""
from importlib import import_module

_EXPORTS = {
    "Surface": "surface", "mesh_surface": "surface", "material_names": "surface", "DEFAULT_RESOLUTION": "surface",
    "check_resolution": "surface", "resolution_memory": "surface", "MIN_RESOLUTION": "surface",
    "TetMesh": "tetmesh", "tet_mesh": "tetmesh", "box_mesh": "tetmesh",
    "Heat": "study", "Elasticity": "study", "Result": "study", "simulate": "study", "simulate_petsc": "distributed",
    "study_from": "study", "check_study": "study", "Section": "section", "section": "section", "plot_section": "section",
    "System": "shape", "assemble": "shape", "node_velocities": "shape", "shape_gradient": "shape",
    "parameter_derivatives": "shape",
    **{n: "objectives" for n in ("Objective", "MeanTemperature", "MaxTemperature", "Compliance", "MaxVonMises",
                                 "Volume", "Mass", "Weighted", "Constraint", "objective_from", "constraint_from")},
    **{n: "optimize" for n in ("optimize", "OptimizeResult", "Design", "evaluate_design", "shape_derivatives",
                               "run_optimize", "plot_history", "save_optimized_scene")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'taperay.solvers' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
