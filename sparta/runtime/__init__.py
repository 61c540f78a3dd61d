"""The kernel modules compiled models call, one per kernel family of ``sparta.templates`` (``bsr_linear``,
``w4a16_gemv``, ``w8a8_gemv``, ``layernorm``, ``quant``: CUDA, TVM-free, through cuda-bindings, ``cuda.py``;
``cpu_linear``: the CPU kernels through the TVM runtime)."""
