"""Test helpers for probe authors and for "replay leaked nothing" oracles: the
probe contract run against states the author gives (``check_probe``) and the
leak oracle (``leak_check``, ``global_state``, ``state_changes``).
"""

from .leaks import GlobalState, global_state, leak_check, state_changes
from .probe_check import check_probe

__all__ = ["GlobalState", "check_probe", "global_state", "leak_check", "state_changes"]
