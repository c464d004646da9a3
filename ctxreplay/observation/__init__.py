"""Watching the live forward: attaching and detaching exactly, the per-call wrapper (the
hot path), the variant table, retained calls, the targets and member identities, and
keeping an observed model plain to copies.
"""
