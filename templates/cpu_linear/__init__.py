"""CPU linears through LLVM: block-sparse (``block_spec.py``, ``block.py``) and fine-grained (``fine_spec.py``,
``fine.py``), fp32, W8A8 and W4A32."""
