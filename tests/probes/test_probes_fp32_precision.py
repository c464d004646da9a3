"""The matmul_precision probe and torch's per-backend ``fp32_precision`` API
(torch >= 2.9).

Setting ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (or mkldnn's,
or cuDNN conv's) makes torch's legacy getters raise ("mix of the legacy and
new APIs"), and some per-backend values -- cuDNN conv/rnn's internal
"default" -- cannot be put back by any torch API once overwritten.  So every
case runs in a subprocess of its own: nothing it sets can leak into another
test.  Each shows that the calls the probe made before this change raise in
that state, that ``observe()`` now succeeds, that replaying the observed
state re-establishes it from a neutral process state, and that the exit
restores every getter -- per-backend and legacy, raising or not -- exactly.

A torch without the API (2.7) runs each case too and shows what a user meets
there: the per-backend attributes are refused by torch (or, for
``torch.backends.fp32_precision``, set on a plain module with no effect), no
legacy getter raises, the probe records no per-backend value, and the legacy
precision is observed and replayed as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

HAS_API = hasattr(torch._C, "_get_fp32_precision_getter")

_TESTS = Path(__file__).resolve().parents[1] / "helpers"  # the suite's shared helpers

# Runs in a fresh interpreter.  SETUP is Python that puts the process in the
# case's state with torch's own public API.
_SCRIPT = r'''
import json, sys
sys.path.insert(0, {tests!r})
import torch
import ctxreplay
from ctxreplay.testing import check_probe
from torch._C._dynamo.guards import GlobalStateGuard

probe = ctxreplay.probes.get_probe("matmul_precision")
G = torch._C._get_fp32_precision_getter
PAIRS = [(b, op) for b in ("generic", "cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn")
         if not (b == "generic" and op != "all")]

def legacy(fn):
    try:
        return ("ok", fn())
    except RuntimeError as exc:
        return ("raises", "mix of the legacy and new" in str(exc))

def torch_view():
    """Everything torch reports, without ctxreplay: the restoration oracle."""
    return {{"pairs": {{f"{{b}}.{{op}}": G(b, op) for b, op in PAIRS}},
            "precision": legacy(torch._C._get_float32_matmul_precision),
            "cublas_tf32": legacy(torch._C._get_cublas_allow_tf32),
            "cudnn_tf32": legacy(torch._C._get_cudnn_allow_tf32)}}

out = {{}}
fresh_view, fresh = torch_view(), probe.observe()
out["fresh_is_neutral_state"] = fresh == probe.neutral_state()

{setup}

live_view = torch_view()
out["live_view"] = live_view
# what the probe called before this change: torch.get_float32_matmul_precision()
# and the legacy cuBLAS / cuDNN TF32 getters
out["old_calls"] = [legacy(torch.get_float32_matmul_precision)[0],
                    legacy(torch._C._get_cublas_allow_tf32)[0],
                    legacy(torch._C._get_cudnn_allow_tf32)[0]]
live = probe.observe()                       # must not raise
out["describe"] = probe.describe(live)
out["live_differs"] = live != fresh
doc = json.loads(json.dumps(probe.encode(live)))
out["roundtrip"] = probe.decode(doc, "$.state") == live
out["encoded"] = doc
out["watch_forward_ok"] = all(g() == e for g, e in probe.watch_forward(live))

# back to a neutral process state, then replay what the live call had
with probe.replay(fresh):
    out["neutral_inside"] = probe.observe() == fresh and torch_view() == fresh_view
    guard = GlobalStateGuard()
    with probe.replay(live):
        out["replayed"] = probe.observe() == live
        out["replayed_view"] = torch_view() == live_view
        out["seen_by_watch"] = (not guard.check()) or not all(
            g() == e for g, e in (*probe.watch(fresh), *probe.watch_forward(fresh)))
    out["restored_to_neutral"] = probe.observe() == fresh and torch_view() == fresh_view
    try:
        with probe.replay(live):
            raise KeyError("body")
    except KeyError:
        pass
    out["restored_after_raise"] = probe.observe() == fresh and torch_view() == fresh_view
out["restored_live"] = probe.observe() == live and torch_view() == live_view

# the whole contract, from a neutral outside state
with probe.replay(fresh):
    check_probe(probe, [live], neutral=fresh)
out["check_probe"] = True
print(json.dumps(out))
'''


def _run(setup: str) -> dict[str, object]:
    script = _SCRIPT.format(tests=str(_TESTS), setup=textwrap.dedent(setup))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# Runs in a fresh interpreter of a torch without the per-backend API: SETUP
# is run as a user would, and what torch raised is recorded.
_WITHOUT_API = r'''
import json
import torch
import ctxreplay
from ctxreplay.testing import check_probe

probe = ctxreplay.probes.get_probe("matmul_precision")

def legacy(fn):
    try:
        return ("ok", fn())
    except RuntimeError:
        return ("raises", None)

out = {{"has_getter": hasattr(torch._C, "_get_fp32_precision_getter")}}
fresh = probe.observe()
try:
{setup}
    out["setup"] = None
except AttributeError as exc:
    out["setup"] = "AttributeError"
live = probe.observe()
out["legacy"] = [legacy(torch.get_float32_matmul_precision)[0],
                 legacy(torch._C._get_cublas_allow_tf32)[0],
                 legacy(torch._C._get_cudnn_allow_tf32)[0]]
out["precision"] = torch.get_float32_matmul_precision()
out["observed"] = live.float32_matmul_precision
out["keys"] = sorted(json.loads(json.dumps(probe.encode(live))))
out["live_differs"] = live != fresh
with probe.replay(fresh):
    out["neutral_inside"] = (probe.observe() == fresh and
                             torch.get_float32_matmul_precision() == fresh.float32_matmul_precision)
    with probe.replay(live):
        out["replayed"] = torch.get_float32_matmul_precision() == out["precision"]
out["restored_live"] = probe.observe() == live
if out["live_differs"]:  # the contract needs a state other than the current one
    with probe.replay(fresh):
        check_probe(probe, [live], neutral=fresh)
out["check_probe"] = out["live_differs"]
print(json.dumps(out))
'''


def _run_without_api(setup: str) -> dict[str, object]:
    body = textwrap.indent(textwrap.dedent(setup), "    ")
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_API.format(setup=body)],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _assert_without_api(setup: str, refused: bool, precision: str) -> None:
    """What a user meets running ``setup`` on a torch without the API: torch
    refuses the per-backend attribute (``refused``), no legacy getter raises,
    the probe records no per-backend value, and the legacy ``precision`` it
    observes is replayed."""
    out = _run_without_api(setup)
    assert out["has_getter"] is False
    assert out["setup"] == ("AttributeError" if refused else None)
    assert out["legacy"] == ["ok", "ok", "ok"]
    assert out["precision"] == out["observed"] == precision
    assert out["keys"] == ["flags", "float32_matmul_precision"]  # no "fp32_precision"
    assert out["live_differs"] is (precision != "highest")
    assert out["neutral_inside"] is True and out["replayed"] is True
    assert out["restored_live"] is True
    assert out["check_probe"] is out["live_differs"]


CASES = {
    # the example: legacy precision getter and cuBLAS TF32 getter raise
    "cuda-matmul-tf32": ('torch.backends.cuda.matmul.fp32_precision = "tf32"',
                         ["raises", "raises", "ok"]),
    "mkldnn-matmul-bf16": ('torch.backends.mkldnn.matmul.fp32_precision = "bf16"',
                           ["raises", "ok", "ok"]),
    "cudnn-conv-ieee": ('torch.backends.cudnn.conv.fp32_precision = "ieee"',
                        ["ok", "ok", "raises"]),
    "generic-tf32": ('torch.backends.fp32_precision = "tf32"', ["raises", "raises", "ok"]),
    # the legacy precision still answers ("high"); cuBLAS TF32 does not
    "cuda-matmul-ieee-after-high": ('torch.set_float32_matmul_precision("high")\n'
                                    'torch.backends.cuda.matmul.fp32_precision = "ieee"',
                                    ["ok", "raises", "ok"]),
    # representable in both APIs: nothing raises, the per-backend values move
    "legacy-medium": ('torch.set_float32_matmul_precision("medium")', ["ok", "ok", "ok"]),
}

#: per case, on a torch without the API: (torch refuses the setting, the
#: legacy precision then) -- ``torch.backends.fp32_precision`` is a plain
#: module attribute there, which takes any value and changes nothing
WITHOUT_API = {"cuda-matmul-tf32": (True, "highest"), "mkldnn-matmul-bf16": (True, "highest"),
               "cudnn-conv-ieee": (True, "highest"), "generic-tf32": (False, "highest"),
               "cuda-matmul-ieee-after-high": (True, "high"),
               "legacy-medium": (False, "medium")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_backend_precision_is_observed_and_replayed(case: str) -> None:
    setup, old_calls = CASES[case]
    if not HAS_API:
        _assert_without_api(setup, *WITHOUT_API[case])
        return
    out = _run(setup)
    assert out["fresh_is_neutral_state"] is True
    # before this change the probe's observe() made these calls: they raise
    assert out["old_calls"] == old_calls
    assert out["live_differs"] is True
    assert out["roundtrip"] is True and out["watch_forward_ok"] is True
    assert out["neutral_inside"] is True
    assert out["replayed"] is True and out["replayed_view"] is True
    assert out["seen_by_watch"] is True
    assert out["restored_to_neutral"] is True and out["restored_after_raise"] is True
    assert out["restored_live"] is True
    assert out["check_probe"] is True
    encoded = out["encoded"]
    assert isinstance(encoded, dict)
    if old_calls[0] == "raises":
        assert encoded["float32_matmul_precision"] is None  # "unavailable", explicitly
        assert "mixed" in str(out["describe"])


def test_the_oracle_in_the_subprocess_can_fail() -> None:
    """A replay that put back only the legacy precision -- what
    ``torch.set_float32_matmul_precision(previous)`` does -- leaves
    ``cuda.matmul`` at "ieee" where a fresh torch has "none": the torch-level
    view the subprocess compares sees it.  Without the API the legacy
    setter leaves no residue: the probe sees the fresh state again."""
    if not HAS_API:
        _assert_without_api('''
            torch.set_float32_matmul_precision("high")
            torch.set_float32_matmul_precision("highest")
        ''', False, "highest")
        return
    out = _run('''
        before = torch_view()
        torch.set_float32_matmul_precision("high")
        torch.set_float32_matmul_precision("highest")
        assert torch_view() != before, "the oracle must see the legacy setter's residue"
        assert probe.observe() != fresh, "and so must the probe"
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    ''')
    assert out["replayed"] is True and out["restored_live"] is True


def test_a_mixed_state_outside_is_restored_after_a_neutral_replay() -> None:
    """The legacy precision is hidden while its getter raises: a replay of the
    neutral state from such a process must bring the raising back on exit.
    Without the API no such state can be made: torch refuses the setting and
    its legacy getter keeps answering."""
    if not HAS_API:
        _assert_without_api(
            'torch.backends.cuda.matmul.fp32_precision = "tf32"', True, "highest")
        return
    out = _run('''
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        mixed_view = torch_view()
        with probe.replay(probe.neutral_state()):
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch_view() == fresh_view
        assert torch_view() == mixed_view
        try:
            torch.get_float32_matmul_precision()
        except RuntimeError:
            pass
        else:
            raise AssertionError("the mixed-API state was not restored")
    ''')
    assert out["restored_live"] is True and out["check_probe"] is True
