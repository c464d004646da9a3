"""A document written under another torch release, read under this one.

A newer torch has settings an older one lacks: the split-K part of cuBLAS's
reduced-precision reductions (2.9), the per-backend fp32_precision API
(2.9), the FA3 attention backend (2.9).  Read where the setting is absent, a
value that means what the older torch always does is accepted; one it
cannot re-establish is refused, naming the field and why.  The older torch
is simulated by taking the setting out of the probe's view of this one
(``tests/loading/test_old_files.py`` reads real files from 2.13 on 2.7).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

import ctxreplay.probes.matmul_precision as mp
import ctxreplay.probes.sdpa_backend as sb


def _matmul_doc(**flags: bool) -> dict[str, Any]:
    doc = {"float32_matmul_precision": "highest",
           "flags": {"cuda_matmul_tf32": False, "cudnn_tf32": True,
                     "cuda_fp16_reduced_precision": True,
                     "cuda_bf16_reduced_precision": True,
                     "cpu_fp16_reduced_precision": False,
                     "cuda_fp16_reduced_precision_split_k": True,
                     "cuda_bf16_reduced_precision_split_k": True}}
    doc["flags"].update(flags)
    return doc


@pytest.fixture
def no_split_k(monkeypatch: pytest.MonkeyPatch) -> None:
    names = tuple(f for f in mp._FIELD_NAMES if f not in mp._SPLIT_K)
    monkeypatch.setattr(mp, "_FIELD_NAMES", names)
    monkeypatch.setattr(mp, "_PAIRS", ())
    monkeypatch.setattr(mp, "_PAIR_KEYS", ())


def test_a_split_k_at_its_default_reads_where_torch_has_no_such_setting(
        no_split_k: None) -> None:
    state = mp._decode(_matmul_doc(), "$")
    assert not any(f in mp._SPLIT_K for f, _ in state.flags)
    assert state.float32_matmul_precision == "highest"


def test_a_split_k_turned_off_is_refused_where_torch_cannot_turn_it_off(
        no_split_k: None) -> None:
    with pytest.raises(ValueError, match=r"\$\.flags\.cuda_bf16_reduced_precision_split_k: "
                                         r"false.*cannot be re-established"):
        mp._decode(_matmul_doc(cuda_bf16_reduced_precision_split_k=False), "$")


def test_per_backend_pairs_read_where_the_legacy_flags_say_the_same(no_split_k: None) -> None:
    doc = _matmul_doc()
    doc["fp32_precision"] = {"generic.all": "none", "cuda.matmul": "ieee",
                             "cuda.conv": "tf32", "mkldnn.matmul": "none"}
    assert mp._decode(doc, "$").fp32_precision == ()
    refused = copy.deepcopy(doc)
    refused["fp32_precision"]["mkldnn.matmul"] = "bf16"
    with pytest.raises(ValueError, match=r"fp32_precision\['mkldnn\.matmul'\]: 'bf16'"):
        mp._decode(refused, "$")
    contradicting = copy.deepcopy(doc)
    contradicting["fp32_precision"]["cuda.matmul"] = "tf32"  # the legacy flag says off
    with pytest.raises(ValueError, match=r"cuda\.matmul"):
        mp._decode(contradicting, "$")


def test_the_same_documents_are_unknown_fields_nowhere_they_have_a_meaning() -> None:
    """Control: under a torch that has the settings (or lacks them), the
    document is read by the normal path -- no field is dropped silently."""
    if set(mp._FIELD_NAMES) >= mp._SPLIT_K:
        state = mp._decode(_matmul_doc(cuda_bf16_reduced_precision_split_k=False), "$")
        assert ("cuda_bf16_reduced_precision_split_k", False) in state.flags
    else:
        with pytest.raises(ValueError, match="split_k: false"):
            mp._decode(_matmul_doc(cuda_bf16_reduced_precision_split_k=False), "$")


def _sdpa_doc(fa3: bool) -> dict[str, Any]:
    probe = sb.SdpaBackendProbe()
    doc = probe.encode(sb._NEUTRAL if sb._NEUTRAL is not None else probe.observe())
    doc["flags"]["fa3"] = fa3
    return doc


@pytest.fixture
def no_fa3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sb, "_NAMES", tuple(n for n in sb._NAMES if n != "fa3"))
    monkeypatch.setattr(sb, "_ABSENT", sb._ABSENT | {"fa3"})


def test_an_absent_backend_disabled_reads_and_enabled_is_refused(no_fa3: None) -> None:
    probe = sb.SdpaBackendProbe()
    state = probe.decode(_sdpa_doc(False), "$")
    assert "fa3" not in dict(state.flags)
    with pytest.raises(ValueError, match=r"\$\.flags\.fa3: true.*no such backend"):
        probe.decode(_sdpa_doc(True), "$")
