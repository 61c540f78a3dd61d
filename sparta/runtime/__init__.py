"""TVM-free runtimes for compiled kernels (CUDA through cuda-bindings)."""
