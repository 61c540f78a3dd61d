"""W4A16 GEMV for decode (1..16 rows): int4 weights dequantised by lop3 into mma.sync (see ``spec.py``)."""
