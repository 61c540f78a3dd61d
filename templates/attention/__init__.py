"""Attention over sizes-only masks: torch SDPA with the mask classified once per shape (see ``runtime.py``)."""
