"""What ``finalize()`` returns and writes: ``CaptureReport``, which probes changed
each graph (explain), and the manifest that indexes saved captures.

The records a report hands back are importable from here: ``CaptureReport``,
``FidelityError``, ``Explanation``, ``CaptureExplanation``, ``ProbeEffect``
(``report.explain``), ``SavedManifest`` (``report.save_all``), and the parts
of a ``Capture`` only some captures fill: ``DistributedDetails``,
``CacheDetails``, ``FoldDetails``.
"""

from ..capture.details import CacheDetails, DistributedDetails, FoldDetails
from .capture_report import CaptureReport, FidelityError
from .explain import CaptureExplanation, Explanation, ProbeEffect
from .manifest import SavedManifest

__all__ = ["CacheDetails", "CaptureExplanation", "CaptureReport", "DistributedDetails",
           "Explanation", "FidelityError", "FoldDetails", "ProbeEffect", "SavedManifest"]
