"""Captures of FSDP2 members, the ranks taking turns.

A capture of a ``fully_shard``-ed member traces and checks it with the
whole parameters FSDP gathers for a call (``capture.sharded``), and
gathering them (``FSDPModule.unshard()``) is an all-gather every rank of
the mesh must join.  Each rank captures its own variants, at its own pace,
so the ranks take turns: in rank order, one rank captures everything it
owns while the others follow it -- each time it gathers FSDP modules it
names them (qualified names in the model), every rank gathers the same
ones at once and lets them go again (the capturing rank keeps a copy for
its view; nothing stays unsharded).  When it is done it says so and the
next rank leads.  A rank that cannot find a module named is said to every
rank before anyone gathers, and the capture is refused (``NotIsolable``):
no rank waits on a gather the others never start.

Turns cost time (the ranks capture one after another) and only start
where some rank's members hold FSDP parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from torch import nn

from ..capture.isolate import NotIsolable
from ..capture.sharded import gathered_here, gathering_by, is_fsdp

__all__ = ["in_turns"]

T = TypeVar("T")
_DONE = "ctxreplay/turn-done"


class Group(Protocol):
    """What taking turns needs of the group (``exchange.RankGroup``)."""

    rank: int
    size: int

    def broadcast(self, obj: Any, src: int) -> Any: ...

    def gather(self, obj: Any) -> list[Any]: ...


def in_turns(group: Group, work: Callable[[], T], root: nn.Module) -> T:
    """``work()`` on this rank in its turn, following the others in theirs.
    What ``work`` raises is raised after the last turn (the other ranks'
    turns still need this one)."""
    names = {id(m): n for n, m in root.named_modules()}
    modules = dict(root.named_modules())
    result: list[T] = []
    failed: BaseException | None = None
    for leader in range(group.size):
        if leader != group.rank:
            _follow(group, leader, modules)
            continue
        try:
            with gathering_by(lambda owners: _leading(group, owners, names)):
                result.append(work())
        except BaseException as exc:  # the turns go on; raised at the end
            failed = exc
        finally:
            group.broadcast(_DONE, leader)
    if failed is not None:
        raise failed
    return result[0]


@contextmanager
def _leading(group: Group, owners: list[nn.Module], names: dict[int, str]) -> Iterator[None]:
    wanted = [names.get(id(o)) for o in owners]
    if any(n is None for n in wanted):  # nothing was said: no rank waits
        raise NotIsolable("an FSDP module whose parameters the member holds is not in the "
                          "model given to capture_with: the other ranks cannot gather it too")
    group.broadcast(wanted, group.rank)
    problems = [p for p in group.gather(None) if p is not None]
    if problems:
        raise NotIsolable(problems[0])
    with gathered_here(owners):
        yield


def _follow(group: Group, leader: int, modules: dict[str, nn.Module]) -> None:
    """Gather what ``leader`` gathers, until it is done."""
    while True:
        wanted = group.broadcast(None, leader)
        if wanted == _DONE:
            return
        found = [modules.get(n) for n in wanted]
        missing = [n for n, m in zip(wanted, found) if m is None or not is_fsdp(m)]
        problem = None if not missing else \
            f"rank {group.rank} has no FSDP module {missing[0]!r} to gather with rank {leader}"
        if any(p is not None for p in group.gather(problem)):
            continue
        with gathered_here([m for m in found if m is not None]):
            pass  # the all-gather is all this rank takes part in
