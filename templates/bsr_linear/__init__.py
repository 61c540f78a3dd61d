"""Block-sparse (and dense) tensor-core linear for CUDA: fp16, W8A8 and W4A16 operands (see ``spec.py``)."""
