"""Per-token int8 quantisation of fp16 activations for the W8A8 kernels (see ``spec.py``)."""
