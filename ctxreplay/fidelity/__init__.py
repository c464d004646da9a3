"""The verdict of a capture against its live calls: ``Mismatch``, ``Fidelity``, the
signature / execute / values comparisons and the neutral replay they run under.
"""
