"""LayerNorm in fp16 with Welford statistics, the residual add and the per-token int8 codes fused (``spec.py``)."""
