"""What ``finalize()`` returns and writes: ``CaptureReport``, which probes changed
each graph (explain), and the manifest that indexes saved captures.

The records a report hands back are importable from here: ``CaptureReport``,
``FidelityError``, ``Explanation``, ``CaptureExplanation``, ``ProbeEffect``
(``report.explain``) and ``SavedManifest`` (``report.save_all``).
"""

from .capture_report import CaptureReport, FidelityError
from .explain import CaptureExplanation, Explanation, ProbeEffect
from .manifest import SavedManifest

__all__ = ["CaptureExplanation", "CaptureReport", "Explanation", "FidelityError",
           "ProbeEffect", "SavedManifest"]
