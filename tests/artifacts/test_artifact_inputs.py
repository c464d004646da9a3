"""What a saved ``.pt2`` holds: the program and its block's weights, and no
tensor at the live call's activation size (torch's example inputs are kept
as ``meta`` placeholders, whose structure torch's size guard is built from;
the sidecar records the input specs).  Such a file still loads, installs and
runs bit-exactly."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import fold_cases as fc
import pytest
import torch
from capability import FOLDS
from torch import nn

import ctxreplay
from ctxreplay.artifacts.pt2 import Pt2Format

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")

DIM = 8
TOKENS = 16384  # an activation of 512 kB, 2**6 times the block's weights


class Block(nn.Module):
    eager_calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.eager_calls += 1
        out: torch.Tensor = torch.tanh(self.lin(x))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _saved(tmp_path: Path) -> tuple[Net, torch.Tensor, Path]:
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.rand(1, TOKENS, DIM)
    with ctxreplay.capture_with(net, targets="repeated", backend="export",
                                verify="execute") as session, torch.no_grad():
        net(x)
    report = session.finalize()
    assert report.ok and len(report.captures) == 1, report.problems
    written = report.save_all(tmp_path)
    assert written.ok and len(written.saved) == 1
    return net, x, written.saved[0].path


def _weight_bytes(net: Net) -> int:
    return sum(t.nbytes for t in net.blocks[0].state_dict().values())


def test_saved_file_holds_no_activation_sized_inputs(tmp_path: Path) -> None:
    net, x, path = _saved(tmp_path)
    beyond = path.stat().st_size - _weight_bytes(net)
    # the graph's JSON and the archive's headers: a few kB, whatever the
    # activation's size (the example inputs torch writes were x's size, 512 kB)
    assert x.nbytes > 500_000
    assert beyond < 16_000, f"{beyond} bytes beyond the weights"
    with zipfile.ZipFile(path) as archive:
        largest = max(i.file_size for i in archive.infolist())
    assert largest < 16_000


def test_file_with_placeholder_inputs_loads_installs_and_runs_bit_exactly(
        tmp_path: Path) -> None:
    net, x, path = _saved(tmp_path)
    program = torch.export.load(path)  # torch's own reader takes it
    (placeholder,), kwargs = program.example_inputs
    assert placeholder.device.type == "meta" and kwargs == {}
    assert (placeholder.shape, placeholder.stride(), placeholder.dtype) == \
        (x.shape, x.stride(), x.dtype)
    with torch.no_grad():
        expected = net(x)
        assert torch.equal(program.module()(x), net.blocks[0](x))  # blocks.0's weights
    source = ctxreplay.load(tmp_path)
    with ctxreplay.install(net, source) as handle, torch.no_grad():
        assert source.check() == ()
        Block.eager_calls = 0
        assert torch.equal(net(x), expected)
        assert Block.eager_calls == 0
        assert handle.stats().total_misses == 0


# -- the graph alone, as the capture cache and the ranks exchange it ----------------

def test_a_folded_capture_from_the_cache_keeps_its_size_guard(tmp_path: Path) -> None:
    """Observed 4, 6, 9; 7 is in range but takes another path.  Served from
    the capture cache (``program_bytes``, the graph alone), the program
    still refuses 7, and ``install`` runs that call eagerly -- as for the
    capture that filled the cache.  (With its example inputs dropped,
    torch's ``module()`` made no guard and 7 ran the traced path: a wrong
    answer from a dispatched call.)"""
    cache = tmp_path / "cache"
    for fill in (True, False):
        model = fc.stack(fc.Special)
        with ctxreplay.capture_with(model, targets="repeated", cache=str(cache)) as session, \
                torch.no_grad():
            for n in (4, 6, 9):
                model(*fc.sequence(n)[0])
        report = session.finalize()
        assert report.ok and [c.from_cache for c in report.captures] == [not fill] * (
            1 if FOLDS else 3)
        # where ctxreplay does not fold, a capture per size: 7 is no size of theirs
        assert all((c.folding is not None) is FOLDS for c in report.captures)
        (x,), _ = fc.sequence(7)
        with torch.no_grad():
            want = model(x)
            with ctxreplay.install(model, report) as handle:
                assert torch.equal(model(x), want), "filled" if fill else "served"
                if FOLDS:
                    assert handle.stats().reasons == {"size_guard": 2}
                assert handle.stats().total_hits == 0
                assert handle.stats().total_misses == 2


def test_program_bytes_hold_placeholder_inputs_and_old_bytes_are_refused() -> None:
    dims = ({1: torch.export.Dim.AUTO},)  # type: ignore[attr-defined]
    x = torch.rand(2, TOKENS, DIM)
    block = fc.Special()
    program = torch.export.export(block, (x,), dynamic_shapes=dims, strict=False)
    fmt = Pt2Format()
    data = fmt.program_bytes(program)
    assert data is not None and len(data) < x.nbytes // 10
    back = fmt.program_from_bytes(data, program.state_dict)
    assert back.example_inputs[0][0].device.type == "meta"
    if FOLDS:
        with pytest.raises(AssertionError, match="Guard failed"):
            back.module()(torch.rand(2, 7, DIM))
    else:
        # this torch's program does not check its trace's size guard: at 7 it
        # runs the traced path (the forward's would triple it) -- why
        # ctxreplay does not fold here
        seven = torch.rand(2, 7, DIM)
        with torch.no_grad():
            got = back.module()(seven)
            assert torch.equal(got, block.lin(seven)) and not torch.equal(got, block(seven))
    # bytes laid out before the inputs were kept: refused, never guardless
    n_head, n_program, n_consts = struct.unpack_from("<III", data)
    at = struct.calcsize("<III")
    head = json.loads(data[at:at + n_head])
    del head["inputs"]
    old_head = json.dumps(head).encode()
    old = struct.pack("<III", len(old_head), n_program, n_consts) + old_head + \
        data[at + n_head:]
    with pytest.raises(ValueError, match="size guard"):
        fmt.program_from_bytes(old, program.state_dict)
