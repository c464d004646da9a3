"""Capture under torchrun: every rank observes its own forward passes;
finalize() captures each distinct variant once across the ranks and gives
every rank the same merged report.

    torchrun --nproc_per_node 2 examples/torchrun_capture.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ctxreplay


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.lin(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def main(out: Path) -> None:
    dist.init_process_group("gloo")  # torchrun sets rank, world size, address
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on every rank
    model = Model().eval()

    session = ctxreplay.capture_with(model, targets="repeated", verify="execute")
    with session, torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for batch in (1, 2 + rank):  # each rank sees one shape of its own
            model(torch.rand(batch, 16))

    report = session.finalize()  # a collective: every rank calls it
    for c in report.captures:
        if rank == 0:
            print(f"{c.scope}#{c.variant}: captured on rank {c.rank}, "
                  f"observed on {list(c.observed_on)}, {c.calls} calls")
    out.mkdir(parents=True, exist_ok=True)
    doc = json.dumps(report.to_json(), sort_keys=True)
    (out / f"report-{rank}.json").write_text(doc)
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
