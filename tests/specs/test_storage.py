"""Where a tensor's data lives, for tensors without ordinary storage.

A wrapper subclass (a quantized weight, a DTensor) raises when its own
storage's address is read; a meta or fake tensor has none worth reading.
``specs.storage`` reaches the ordinary tensors behind a wrapper through
``__tensor_flatten__`` and never raises.
"""

from __future__ import annotations

import torch
from quantized import Int8Weight
from torch._subclasses.fake_tensor import FakeTensorMode

from ctxreplay.specs.storage import inner_tensors, same_data, storage_ptr, storage_ptrs


def test_a_wrapper_has_no_storage_of_its_own_its_inner_tensors_do() -> None:
    w = Int8Weight.quantize(torch.randn(4, 3))
    try:
        w.untyped_storage().data_ptr()
        raised = False
    except RuntimeError:
        raised = True
    assert raised  # the fact the helpers exist for
    assert storage_ptr(w) is None
    assert [p for p, _ in inner_tensors(w)] == ["qdata", "scale"]
    assert storage_ptrs(w) == (w.qdata.untyped_storage().data_ptr(),
                               w.scale.untyped_storage().data_ptr())


def test_a_wrapper_inside_a_wrapper_is_flattened_again() -> None:
    inner = Int8Weight.quantize(torch.randn(4, 3))
    outer = Int8Weight(inner, torch.ones(4))  # qdata is itself a wrapper
    assert [p for p, _ in inner_tensors(outer)] == ["qdata.qdata", "qdata.scale", "scale"]
    assert len(storage_ptrs(outer)) == 3


def test_tensors_without_readable_storage_give_none() -> None:
    assert storage_ptr(torch.empty(3, device="meta")) is None
    with FakeTensorMode():
        fake = torch.empty(3)
    assert storage_ptr(fake) is None
    assert storage_ptrs(torch.empty(0)) == ()  # nothing allocated
    plain = torch.ones(3)
    assert storage_ptr(plain) == plain.untyped_storage().data_ptr()


def test_same_data_compares_wrappers_by_their_inner_tensors() -> None:
    w = Int8Weight.quantize(torch.randn(4, 3))
    twin = Int8Weight(w.qdata.clone(), w.scale.clone())
    other = Int8Weight(w.qdata.clone(), w.scale * 2)
    assert same_data(w, twin)
    assert not same_data(w, other)
    assert not same_data(w, w.dequantize())  # a wrapper is not its plain value
    assert same_data(torch.ones(2), torch.ones(2))
    assert not same_data(torch.ones(2), torch.ones(2, dtype=torch.float64))
