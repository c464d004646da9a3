"""Ahead-of-time compiling of saved captures: ``compile_dir`` (``ctxreplay compile DIR``)
lifts each capture's member tensors to inputs, compiles it with AOTInductor -- a folded
capture with its dynamic dims --, checks it against the uncompiled program within a
tolerance per dtype (``TOLERANCES``), and records it in the manifest, for ``install`` to run.
"""

from .compile import CompiledDir, compile_dir
from .verify import TOLERANCES

__all__ = ["TOLERANCES", "CompiledDir", "compile_dir"]
