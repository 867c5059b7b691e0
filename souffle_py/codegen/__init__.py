"""Code generation: kernels (PrimFuncs) from a TEProgram, and building them for a target."""
