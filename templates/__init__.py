"""Kernel templates parameterised by block shape, bits and compile-time sparsity."""
