"""W8A8 GEMV for decode (1..16 rows): int8 weights per channel, int8 activations per token (see ``spec.py``)."""
