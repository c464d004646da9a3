"""The environment an artifact records: what torch's autocast casts.

The oracle is torch's own dispatcher: kernels registered for ``AutocastCPU``
through ``torch.library`` -- by another library's operator, and by one of
torch's own -- and the digest read again after each."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ctxreplay._base import environment


@pytest.fixture
def fresh_digest() -> Iterator[None]:
    environment.autocast_policy.cache_clear()
    yield
    environment.autocast_policy.cache_clear()


def _with_autocast_kernel(namespace: str, kind: str, op: str) -> torch.library.Library:
    lib = torch.library.Library(namespace, kind)  # type: ignore[no-untyped-call]
    if kind == "DEF":
        lib.define(f"{op}(Tensor x) -> Tensor")
    lib.impl(op, lambda x: x * 2, "AutocastCPU")
    return lib


@pytest.mark.usefixtures("fresh_digest")
def test_another_librarys_autocast_kernels_leave_the_digest_alone() -> None:
    """As ``import torchvision`` registers ``torchvision::nms``: a process that
    imported such a library and one that did not record the same policy."""
    before = environment.autocast_policy()
    lib = _with_autocast_kernel("ctxreplay_env_test", "DEF", "twice")
    try:
        assert "ctxreplay_env_test::twice" in map(
            str, torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
        environment.autocast_policy.cache_clear()
        assert environment.autocast_policy() == before
    finally:
        lib._destroy()


@pytest.mark.usefixtures("fresh_digest")
def test_an_autocast_kernel_of_torchs_own_operator_changes_the_digest() -> None:
    """What the digest is for: a torch whose autocast casts another aten
    operator (2.12 added ``rms_norm``) records another policy."""
    registered = set(map(str, torch._C._dispatch_get_registrations_for_dispatch_key(
        "AutocastCPU")))
    assert "aten::sinh" not in registered  # the operator the kernel is added for
    before = environment.autocast_policy()
    lib = _with_autocast_kernel("aten", "IMPL", "sinh")
    try:
        environment.autocast_policy.cache_clear()
        assert environment.autocast_policy()["cpu"] != before["cpu"]
    finally:
        lib._destroy()
    environment.autocast_policy.cache_clear()
    assert environment.autocast_policy() == before
