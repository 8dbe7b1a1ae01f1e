"""Evaluation that needs its own machinery: the kNN monitor of frozen features."""
