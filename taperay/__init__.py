"""taperay: 3D scenes as records. ``import taperay as tr`` gives the whole public API:

    part = tr.difference(tr.box(1, 1, 0.25), tr.cylinder(tr.Param("hole", 0.3), 1))
    tape = tr.flatten(part)                       # the scene as tape records, validated
    d, mat = tr.walker("cpu").evaluate(tape, [[0, 0, 2]])
    tr.write_png("part.png", tr.walker("auto").render(tape, None, 640, 480))

The names below are loaded on first use (``taperay --help`` imports no Numba or wgpu). The
subpackages own the parts: runtime (tape format, walkers), shaders (WGSL files), scenegraph
(modelling API, files, importers), solvers, tools (command line, benchmarks), scenes (examples).
"""
from importlib import import_module

__version__ = "0.1.0"

# public name -> the module that owns it
_EXPORTS = {
    **{name: "taperay.scenegraph.nodes" for name in (
        "Node", "Param", "Material", "DEFAULT_MATERIAL", "sphere", "box", "rounded_box", "cylinder",
        "capped_cone", "capsule", "torus", "ellipsoid", "plane", "extrude", "revolve", "union",
        "intersection", "difference", "xor", "smooth_union", "smooth_intersection", "smooth_difference")},
    "field": "taperay.scenegraph.fields", "vm_field": "taperay.scenegraph.fields",
    "flatten": "taperay.scenegraph.flatten", "node_bounds": "taperay.scenegraph.flatten",
    "load": "taperay.scenegraph.loading:load_tape", "load_scene_module": "taperay.scenegraph.loading",
    "load_vm": "taperay.scenegraph.vm",
    "save_tape": "taperay.scenegraph.files", "save_scene": "taperay.scenegraph.files",
    "load_file": "taperay.scenegraph.files",
    "Tape": "taperay.runtime.tape", "TaperayError": "taperay.runtime.tape", "validate": "taperay.runtime.tape",
    "Op": "taperay.runtime.opcodes", "OPS": "taperay.runtime.opcodes",
    "CpuWalker": "taperay.runtime.cpu", "GpuWalker": "taperay.runtime.gpu", "JaxWalker": "taperay.runtime.jax_walker",
    "walker": "taperay.runtime.walkers", "run_on": "taperay.runtime.walkers",
    "RenderSettings": "taperay.runtime.shading", "VIEWS": "taperay.runtime.shading",
    "Camera": "taperay.runtime.camera", "auto_camera": "taperay.runtime.camera",
    "write_png": "taperay.runtime.image",
    "conform_tape": "taperay.runtime.conformance", "conform_random": "taperay.runtime.conformance",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'taperay' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(import_module(module), attr or name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
