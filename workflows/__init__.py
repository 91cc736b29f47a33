"""Deterministic workflow code: no I/O here, only decisions from what activities read from the row."""
