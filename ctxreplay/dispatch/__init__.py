"""Captured graphs back in a live model: ``install``, its per-member wrappers, and each
member's program bound to its weights and compiled once.
"""
