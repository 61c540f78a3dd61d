"""Specialisation and build of kernels through TVM (TVM is imported lazily)."""
