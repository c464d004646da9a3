"""Why one variant's capture failed, carried out of the capture as an exception.

``failure(request, backend, reason, exc)`` makes the ``CaptureFailed`` every
step of a capture raises: the report's ``CaptureFailure`` (a reason code,
the exception's type and message, the variant's context in words) inside.
"""

from __future__ import annotations

import logging

import attrs

from ..backends import Backend, exception_message
from ..errors import Error
from .options import VariantRequest
from .results import CaptureFailure

__all__ = ["CaptureFailed", "failure", "with_context"]


class CaptureFailed(Error):
    """Carries a ``CaptureFailure`` out of ``capture_variant``."""

    def __init__(self, failure: CaptureFailure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


def with_context(failed: CaptureFailed, context: dict[str, str]) -> CaptureFailed:
    """``failed`` with ``context`` added to what its failure says of the call."""
    return CaptureFailed(attrs.evolve(failed.failure,
                                      context={**failed.failure.context, **context}))


def failure(request: VariantRequest, backend: Backend, reason: str,
             exc: BaseException | None,
             attempts: tuple[tuple[str, str, str], ...] = ()) -> CaptureFailed:
    """``request``'s capture failed for ``reason`` (a code of
    ``FAILURE_REASONS``), with the exception that caused it, logged at debug
    level with its traceback (the report keeps its type and message only)."""
    exc_type, message = ("-", "") if exc is None else exception_message(exc)
    try:
        context = request.snapshot.describe()
    except Exception:  # a probe's describe may raise anything: no context
        context = {}
    if exc is not None:
        logging.getLogger("ctxreplay").debug(
            "capture of %s#%d failed: %s", request.scope, request.variant, reason,
            exc_info=(type(exc), exc, exc.__traceback__))
    return CaptureFailed(CaptureFailure(request.scope, request.variant, backend.name, reason,
                                        exc_type, attempts, context, message))


