"""``check_probe`` tells a probe author which rule the probe broke.

A probe that breaks the contract the way authors do by mistake (a
``replay`` without ``@contextmanager``, one that returns nothing, an
unhashable state, a ``split_replay`` that returns no context) fails
``check_probe`` with an ``AssertionError`` that names the probe, the state
and the rule -- never a raw ``TypeError`` from deep inside ``with``, and
never another diagnosis (a leak) than the one that is true.
"""

from __future__ import annotations

from typing import Any

import bad_probes as bad
import pytest

from ctxreplay.probes import ContextProbe
from ctxreplay.testing import check_probe


@pytest.fixture(autouse=True)
def _setting_back() -> Any:
    """A broken replay cannot put the setting back: the next test starts at "a"."""
    yield
    bad.SETTING["mode"] = "a"


def _failure(probe: ContextProbe[Any], state: Any) -> str:
    with pytest.raises(AssertionError) as info:
        check_probe(probe, [state])
    return str(info.value)


def test_a_good_probe_passes() -> None:
    check_probe(bad.Good(), ["b"])


def test_a_replay_without_contextmanager_names_the_probe_the_state_and_the_rule() -> None:
    text = _failure(bad.BareGenerator(), "b")
    assert "probe 'bare_generator'" in text and "mode=b" in text
    assert "returned a generator" in text and "@contextlib.contextmanager" in text
    assert bad.SETTING["mode"] == "a"  # the generator never ran


def test_a_replay_returning_none_is_not_called_a_leak() -> None:
    text = _failure(bad.ReturnsNone(), "b")
    assert "probe 'returns_none'" in text and "mode=b" in text
    assert "returned None" in text and "must return a context manager" in text
    assert "leak" not in text


def test_an_unhashable_state_names_its_type_and_the_rule() -> None:
    text = _failure(bad.Unhashable(), ["b"])
    assert "probe 'unhashable'" in text
    assert "unhashable state of type list" in text and "states must be hashable" in text


def test_a_split_replay_returning_no_context_names_the_rule() -> None:
    text = _failure(bad.BadSplit(), "b")
    assert "probe 'bad_split'" in text and "split_replay" in text
    assert "context manager or None" in text
