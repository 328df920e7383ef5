"""shaders: the WGSL kernels as verbatim files, loaded by runtime.gpu."""
