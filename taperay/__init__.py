"""taperay: 3D scenes as records. The public namespace; the subpackages own the parts:

runtime (tape format, walkers), shaders (WGSL files), scenegraph (modelling API, files,
importers), solvers, tools (command line, benchmarks), scenes (examples).
"""
__version__ = "0.1.0"
