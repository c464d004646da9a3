"""The probe, exposed through the ``ctxreplay.probes`` entry point."""

from __future__ import annotations

from ctxreplay.probes import ForwardContextProbe

from .framework import ForwardContext, get_forward_context, set_forward_context


def _key(ctx: ForwardContext) -> tuple[str, float]:
    # Calls whose contexts agree on these fields trace the same graph.
    return (ctx.attn_backend, ctx.scale)


probe = ForwardContextProbe(
    get_forward_context,
    set_forward_context,
    name="example_forward_context",
    key=_key,
)
