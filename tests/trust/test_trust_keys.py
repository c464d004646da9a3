"""Keys and verification over the whole session: a capture stands
only for calls it reproduces, whatever changed between them.

A plain attribute toggled for one call and restored, a reused argument
object mutated, nested metadata values and callables, a swapped attention
processor, peft's ``disable_adapter()``, ``train()`` before ``finalize()``,
a sparse input, and a module-level global only ``verify="values"`` can see.
Each test records what really ran with its own forward hooks registered
before the session (tests/helpers/trust_oracle.py), runs every recorded call through
the capture that claims it with that member's own weights, compares by
value -- and shows the oracle failing where the calls are forced into one
capture (``ignore_attributes``) or run through another variant's capture.
"""

from __future__ import annotations

import json
import threading
import types
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from trust_oracle import Call, candidates, record, replay_failure, unreproduced

import ctxreplay
from ctxreplay import cli
from ctxreplay.observation.targets import identity_digest, identity_of

# torch's own export internals warn about a deprecated pytree spelling
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DIM = 8


def _digests(model: nn.Module, name: str = "") -> tuple[list[str], Any]:
    """Per call of ``name``, the digest of its identity when it ran (its
    own pre-hook, registered before the session like ``record``'s)."""
    seen: list[str] = []
    mod = dict(model.named_modules())[name]
    handle = mod.register_forward_pre_hook(
        lambda m, a: seen.append(identity_digest(identity_of(m))))
    return seen, handle


def _by_identity(digests: list[str], calls: list[Call]) -> Any:
    """The capture claiming a call: the one recorded under its identity."""
    order = {id(c): i for i, c in enumerate(calls)}

    def pick(call: Call, found: list[ctxreplay.Capture]) -> list[ctxreplay.Capture]:
        want = digests[order[id(call)]]
        return [c for c in found if (call.member, want) in c.identities]
    return pick


# -- a plain attribute off for one call, then restored --------------------------------

class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.use_gate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.sigmoid(y) * y if self.use_gate else y


def _gate_session(verify: str, **options: Any) -> tuple[ctxreplay.CaptureReport, list[Call],
                                                        list[str]]:
    torch.manual_seed(0)
    model = Gate().eval()
    x = torch.randn(2, DIM)
    digests, handle = _digests(model)
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model, backend="export", verify=verify,
                                    **options) as session, torch.no_grad():
            model(x)
            model(x)  # a memo hit: the toggle below must still be seen
            model.use_gate = False
            model(x)
            model.use_gate = True
            model(x)
        report = session.finalize()
    handle.remove()
    assert model.use_gate is True
    assert "__setattr__" not in Gate.__dict__  # the watch went with the session
    return report, calls, digests


@pytest.mark.parametrize("verify", ["signature", "values"])
def test_toggled_attribute_splits_the_variant_and_each_capture_reproduces(verify: str) -> None:
    report, calls, digests = _gate_session(verify)
    assert report.ok, report.to_json()
    assert sorted(c.calls for c in report.captures) == [1, 3]
    assert unreproduced(report, calls, _by_identity(digests, calls)) == []
    if verify == "values":  # every call retained (first, last, between) and checked
        assert sorted(c.checked for c in report.captures) == [1, 3]
    # the odd call really runs another graph: through the other capture it fails
    odd = calls[2]
    (other,) = [c for c in report.captures if c.calls == 3]
    assert replay_failure(other, odd) is not None


def test_the_oracle_catches_the_toggle_when_the_attribute_is_ignored() -> None:
    # forced into one variant, the odd call is not reproduced: signature says
    # ok (it cannot see values), values checks every call and says not ok
    report, calls, _ = _gate_session("signature", ignore_attributes=("use_gate",))
    assert len(report.captures) == 1 and report.captures[0].calls == 4
    assert len(unreproduced(report, calls)) == 1
    assert report.ok  # the lie verify="values" exists to catch
    report, calls, _ = _gate_session("values", ignore_attributes=("use_gate",))
    (c,) = report.captures
    assert not report.ok and c.checked == 4
    assert any(m.level == "values" for m in c.fidelity.mismatches)


class Config:
    """A value-comparable config object the block holds (a framework's config)."""

    def __init__(self) -> None:
        self.act = "relu"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


class Configured(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.relu(y) if self.config.act == "relu" else torch.tanh(y)


def test_a_field_of_a_held_config_changed_for_one_call_splits_the_variant() -> None:
    torch.manual_seed(0)
    config = Config()
    model = Configured(config).eval()
    x = torch.randn(2, DIM)
    digests, handle = _digests(model)
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model, backend="export") as session, torch.no_grad():
            model(x)
            model(x)
            config.act = "tanh"  # on the config object, not on the module
            model(x)
            config.act = "relu"
            model(x)
        report = session.finalize()
    handle.remove()
    assert "__setattr__" not in Config.__dict__  # the watch is gone with the session
    assert report.ok
    assert sorted(c.calls for c in report.captures) == [1, 3]
    assert unreproduced(report, calls, _by_identity(digests, calls)) == []
    (other,) = [c for c in report.captures if c.calls == 3]
    assert replay_failure(other, calls[2]) is not None


class LockedConfig(Config):
    """A config holding a lock: it cannot be copied when the variant runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LockedConfig) and self.act == other.act


def test_a_state_that_cannot_be_recorded_fails_the_capture_with_its_name() -> None:
    torch.manual_seed(0)
    config = LockedConfig()
    model = Configured(config).eval()
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model, backend="export") as session, torch.no_grad():
            config.act = "tanh"
            model(torch.randn(2, DIM))
            config.act = "relu"  # finalize() finds relu, the call ran tanh
            model(torch.randn(2, DIM))
        report = session.finalize()
    assert not report.ok
    (failure,) = report.failures
    assert failure.reason == "state_not_restorable"
    assert "config" in failure.context["attribute"]
    (ok,) = report.captures  # the relu call, made in the state finalize() finds
    assert replay_failure(ok, calls[1]) is None
    assert replay_failure(ok, calls[0]) is not None  # what a capture of the tanh call would be


# -- a module-level global: out of the fingerprint's reach, caught by values ----------

FLAG = {"relu": True}


class ReadsGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return F.relu(y) if FLAG["relu"] else y


@pytest.mark.parametrize("odd", [1, 11])
def test_module_global_off_for_one_call_is_caught_by_values_anywhere_in_the_session(
        odd: int) -> None:
    # the odd call in the middle of three, or the last of twelve (the
    # reservoir keeps the last call): before, only the first call was checked
    torch.manual_seed(0)
    model = ReadsGlobal().eval()
    n = 3 if odd == 1 else 12
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model, backend="export", verify="values") as session, \
                torch.no_grad():
            for i in range(n):
                FLAG["relu"] = i != odd
                model(torch.randn(2, DIM))
        FLAG["relu"] = True
        report = session.finalize()
    bad = unreproduced(report, calls)
    assert [b.split(" via")[0] for b in bad] == [f"call {odd} of "]  # the oracle's verdict
    (c,) = report.captures
    assert not report.ok and not c.fidelity.ok
    assert c.calls == n and c.checked == min(n, 2 + ctxreplay.observation.retained.BETWEEN)
    assert f"{c.checked} of {n} calls checked by value" in c.verdict
    assert c.verdict.startswith("NOT OK")


# -- argument objects: reused and mutated, or fresh with nested fields -----------------

class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, meta: Any) -> torch.Tensor:
        scale = meta["scale"] if isinstance(meta, dict) else meta.scale
        return self.lin(x) * scale


class MetaDict(dict):  # type: ignore[type-arg]
    pass


def _content(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else vars(value)


def _by_content(call: Call, found: list[ctxreplay.Capture]) -> list[ctxreplay.Capture]:
    """The capture whose constant argument holds what the call was given."""
    return [c for c in found if _content(c.signature.args[1].value) == _content(call.args[1])]


@pytest.mark.parametrize("make", [lambda: types.SimpleNamespace(scale=1.0),
                                  lambda: MetaDict(scale=1.0)],
                         ids=["SimpleNamespace", "dict subclass"])
def test_reused_argument_mutated_between_calls_is_keyed_by_content(make: Any) -> None:
    torch.manual_seed(0)
    model = Scaled().eval()
    x = torch.randn(2, DIM)
    meta = make()
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model, backend="export", verify="signature") as session, \
                torch.no_grad():
            for scale in (1.0, 3.0, 1.0):
                if isinstance(meta, dict):
                    meta["scale"] = scale
                else:
                    meta.scale = scale
                model(x, meta)
        report = session.finalize()
    assert report.ok
    assert sorted(c.calls for c in report.captures) == [1, 2]
    assert unreproduced(report, calls, _by_content) == []
    # one capture for both scales would be wrong for the odd call
    first = next(c for c in report.captures if c.calls == 2)
    assert replay_failure(first, calls[1]) is not None


class Meta:
    """A metadata object a framework builds per step (default ``__eq__``)."""

    def __init__(self, flags: dict[str, bool], fn: Any) -> None:
        self.flags = flags
        self.fn = fn


class ReadsMeta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, meta: Meta) -> torch.Tensor:
        y = self.lin(x)
        if meta.flags["relu"]:
            y = F.relu(y)
        return meta.fn(y)


def test_nested_metadata_values_and_callable_fields_are_keyed() -> None:
    torch.manual_seed(0)
    model = ReadsMeta().eval()
    x = torch.randn(2, DIM)
    metas = [Meta({"relu": True}, torch.tanh), Meta({"relu": False}, torch.tanh),
             Meta({"relu": True}, torch.sigmoid), Meta({"relu": True}, torch.tanh)]
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model, backend="export", verify="signature") as session, \
                torch.no_grad():
            for m in metas:
                model(x, m)
        report = session.finalize()
    assert report.ok
    assert sorted(c.calls for c in report.captures) == [1, 1, 2]

    def pick(call: Call, found: list[ctxreplay.Capture]) -> list[ctxreplay.Capture]:
        return [c for c in found if c.signature.args[1].value.flags == call.args[1].flags
                and c.signature.args[1].value.fn is call.args[1].fn]
    assert unreproduced(report, calls, pick) == []
    first = next(c for c in report.captures if c.calls == 2)
    assert replay_failure(first, calls[1]) is not None  # the dict field matters
    assert replay_failure(first, calls[2]) is not None  # and the callable


# -- a swapped attention processor (diffusers) ----------------------------------------

def test_diffusers_set_processor_swap_gets_a_capture_per_processor() -> None:
    attention_processor = pytest.importorskip("diffusers.models.attention_processor")

    class Doubled(attention_processor.AttnProcessor2_0):  # type: ignore[misc,name-defined]
        def __call__(self, attn: Any, hidden_states: torch.Tensor, *args: Any,
                     **kwargs: Any) -> torch.Tensor:
            return 2.0 * super().__call__(attn, hidden_states, *args, **kwargs)

    torch.manual_seed(0)
    model = nn.Sequential(attention_processor.Attention(query_dim=16, heads=2,
                                                        dim_head=8)).eval()
    digests, handle = _digests(model, "0")
    with record(model, ["0"]) as calls:
        with ctxreplay.capture_with(model, targets=["0"], backend="export",
                                    verify="values") as session, torch.no_grad():
            model(torch.randn(1, 4, 16))
            model[0].set_processor(Doubled())
            model(torch.randn(1, 4, 16))
            model(torch.randn(1, 4, 16))
        report = session.finalize()
    handle.remove()
    assert isinstance(model[0].processor, Doubled)  # finalize() left the user's choice
    assert report.ok, report.to_json()
    assert sorted(c.calls for c in report.captures) == [1, 2]
    assert unreproduced(report, calls, _by_identity(digests, calls)) == []
    swapped = next(c for c in report.captures if c.calls == 2)
    assert replay_failure(swapped, calls[0]) is not None  # the processor matters


# -- peft LoRA with some calls under disable_adapter() --------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.v(torch.tanh(self.q(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_peft_disable_adapter_gets_a_capture_per_adapter_state() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, target_modules=["q", "v"], init_lora_weights=False)
    model = peft.get_peft_model(Stack(), config).eval()
    names = [n for n, m in model.named_modules() if isinstance(m, Block)]
    seen: list[str] = []
    handles = [dict(model.named_modules())[n].register_forward_pre_hook(
        lambda m, a: seen.append(identity_digest(identity_of(m)))) for n in names]
    with record(model, names) as calls:
        with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                    verify="signature") as session, torch.no_grad():
            for i in range(4):
                if i % 2:
                    with model.disable_adapter():
                        model(torch.randn(2, DIM))
                else:
                    model(torch.randn(2, DIM))
        report = session.finalize()
    for h in handles:
        h.remove()
    assert len(calls) == 8
    assert report.ok, report.to_json()
    # adapter on and adapter off, each for both layers
    assert len(report.captures) == 2 and sorted(c.calls for c in report.captures) == [4, 4]
    assert unreproduced(report, calls, _by_identity(seen, calls)) == []
    on = next(c for c in report.captures if (calls[0].member, seen[0]) in c.identities)
    assert replay_failure(on, calls[2]) is not None  # an adapter-off call: another graph


# -- train() before finalize(): the mode the calls ran in -----------------------------

class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


@pytest.mark.parametrize("verify", ["execute", "values"])
def test_observed_in_eval_then_train_before_finalize_captures_eval(verify: str) -> None:
    torch.manual_seed(0)
    model = Dropping().eval()
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model, backend="export", verify=verify) as session, \
                torch.no_grad():
            model(torch.randn(4, DIM))
            model(torch.randn(4, DIM))
        model.train()
        report = session.finalize()
    assert model.training and model.drop.training  # the user's flags, as they set them
    assert report.ok
    assert unreproduced(report, calls) == []
    # the failure this prevents: the block in train mode drops values
    with torch.no_grad():
        assert not torch.equal(model(calls[0].args[0]), calls[0].out[0])


# -- tensor layout -----------------------------------------------------------------------

class SparseAware(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_sparse:
            return torch.sparse.mm(x, self.w)
        return (x @ self.w) * 2


def test_sparse_input_is_keyed_by_layout_and_never_captured_as_dense() -> None:
    torch.manual_seed(0)
    model = SparseAware()
    dense = torch.randn(2, DIM)
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model, backend="export", verify="values") as session, \
                torch.no_grad():
            model(dense)
            model(dense.to_sparse())
        report = session.finalize()
    assert not report.ok
    (c,) = report.captures
    assert c.calls == 1 and all(s.layout == "strided" for _, s in c.signature.leaves())
    (f,) = report.failures
    assert f.reason == "unsupported_layout" and f.context["args[0]"] == "sparse_coo"
    assert "sparse_coo" in json.dumps(report.to_json())
    # the dense call is reproduced; no capture claims the sparse one
    assert replay_failure(c, calls[0]) is None
    assert candidates(report, calls[1]) == [c]  # the oracle's shape match alone...
    assert replay_failure(c, calls[1], ambient=False) is not None  # ...would be wrong


# -- what is retained, and only when asked --------------------------------------------

def test_no_tensor_retained_unless_values_and_then_within_retain_bytes() -> None:
    torch.manual_seed(0)
    model = Gate().eval()
    x = torch.randn(4, DIM)
    ref = weakref.ref(x)
    with ctxreplay.capture_with(model, backend="export", verify="signature") as session, \
            torch.no_grad():
        model(x)
        del x
        assert ref() is None  # the open session holds no input
    assert session.finalize().retained is None
    budget = 3 * 2 * (4 * DIM * 4)  # three calls' inputs and outputs
    with ctxreplay.capture_with(model, backend="export", verify="values",
                                retain_bytes=budget) as session, torch.no_grad():
        for _ in range(10):
            x = torch.randn(4, DIM)
            ref = weakref.ref(x)
            model(x)
            del x
            assert ref() is None  # copies, never the live tensors
    report = session.finalize()
    r = report.retained
    assert r is not None and r["retain_bytes"] == budget
    assert 0 < r["peak_bytes"] <= budget and r["retained_bytes"] <= budget
    (c,) = report.captures
    assert c.calls == 10 and 2 <= c.checked <= 3
    assert report.to_json()["captures"][0]["checked"] == c.checked
    # the first, the last and a sample between do not fit: the calls given
    # up to make room were never compared, so the capture is not proven
    assert c.fidelity.not_retained > 0
    assert [m.field for m in c.fidelity.mismatches] == ["retained"]
    assert not report.ok


def test_checked_is_in_the_manifest_sidecar_and_inspect(tmp_path: Any,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    report, _, _ = _gate_session("values")
    saved = report.save_all(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(e["capture"]["checked"] for e in manifest["captures"]) == [1, 3]
    sides = [json.loads(s.sidecar.read_text()) for s in saved.saved]
    assert sorted((d["checked"], d["calls"]) for d in sides) == [(1, 1), (3, 3)]
    assert all(d["fidelity"]["by_value"] == d["checked"] for d in sides)
    assert cli.main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert " 3/3 " in out and " 1/1 " in out


# -- a callable object the block holds, changed in place after its calls ----------------

class Scaler:
    """A callable holding a setting of its own (as an attention processor
    holds its backend): changed in place, not reassigned."""

    def __init__(self) -> None:
        self.scale = 2.0

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.scale


class ScalerHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.act = Scaler()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.lin(x))
        return out


def test_a_callable_changed_in_place_after_its_calls_is_traced_as_the_calls_saw_it() -> None:
    torch.manual_seed(0)
    model = ScalerHolder().eval()
    x = torch.randn(2, DIM)
    with record(model, [""]) as calls, \
            ctxreplay.capture_with(model, backend="export", verify="signature") as session, \
            torch.no_grad():
        model(x)
        model.act.scale = 3.0  # after the call, before finalize: no call saw it
        report = session.finalize()
    assert report.ok, report.to_json()
    assert unreproduced(report, calls) == []  # traced at 2.0, not the 3.0 finalize found
    # the oracle fails where the capture is traced under the changed setting
    with ctxreplay.capture_with(model, backend="export", verify="signature") as session, \
            torch.no_grad():
        model(x)
        other = session.finalize()
    assert unreproduced(other, calls) != []
