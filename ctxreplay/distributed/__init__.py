"""``finalize()`` across the ranks of a ``torch.distributed`` group: joining, exchanging
variant keys, the assignment plan, captures on the wire, and running graphs that hold
collectives on every rank together.
"""
