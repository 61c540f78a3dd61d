"""Dense W8A8 linear on the CPU through oneDNN's int8 GEMM (see ``runtime.py``)."""
