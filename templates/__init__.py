"""Kernel templates, one folder per kernel family, parameterised by shape, block, bits and compile-time sparsity.

Each family holds a TVM-free ``spec.py`` (the spec dataclass, packing, the torch reference: what its run-time module
in ``sparta/runtime/<family>.py`` imports) and its kernels beside it (``kernel.py``: the template ``build_cuda`` or
``build_cpu`` takes; a family with several variants keeps each in a file named for what it is):

* ``bsr_linear/``: block-sparse and dense tensor-core linear, fp16, W8A8 and W4A16 (``mma.sync``, streaming grid,
  ``wgmma``, warp-specialised);
* ``w4a16_gemv/``, ``w8a8_gemv/``: the decode GEMVs (few rows) on 4-bit and on int8 weights;
* ``layernorm/``: LayerNorm, optionally with the residual add and the per-token int8 codes;
* ``quant/``: the per-token int8 quantiser, and the quantisation macros the LayerNorm kernel shares;
* ``cpu_linear/``: the CPU block-sparse and fine-grained linears (LLVM), ``block_spec.py`` / ``fine_spec.py`` beside
  their kernels.

Shared by the CUDA families: ``ptx.py`` (inline-PTX device functions), ``epilogue.py`` (the epilogue value as TIR)
and ``epilogue_ref.py`` (its torch twin).
"""
