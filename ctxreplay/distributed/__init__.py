"""``finalize()`` across the ranks of a ``torch.distributed`` group: joining, exchanging
variant keys, the assignment plan, captures on the wire, running graphs that hold
collectives on every rank together, and capturing in turns where FSDP2 parameters must be
gathered by every rank.
"""

import contextlib

import torch.distributed as _dist

if _dist.is_available() and not _dist.is_initialized():
    # torch.distributed.nn.functional binds ``group.WORLD`` -- the process group
    # itself, once one exists -- as the default argument of its collectives
    # when it is first imported, and torch._dynamo imports it (through FSDP and
    # sharded tensors).  First imported by a capture, after
    # init_process_group(), it would hold the user's group for the rest of the
    # process: destroy_process_group() would no longer free it, and its gloo
    # threads and sockets would live on into interpreter teardown.  Imported
    # here, while no group exists, its defaults are None (the default group).
    with contextlib.suppress(ImportError):
        import torch.distributed.nn.functional  # noqa: F401
