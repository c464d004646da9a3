"""``finalize()`` across the ranks of a ``torch.distributed`` group: joining, exchanging
variant keys, the assignment plan, captures on the wire, running graphs that hold
collectives on every rank together, and capturing in turns where FSDP2 parameters must be
gathered by every rank.
"""
