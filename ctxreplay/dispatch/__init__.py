"""Captured graphs back in a live model: ``install``, its per-member wrappers, each
capture's program as one flat function run with the member's own tensors, and the
watch over the hooks a graph would skip.
"""
