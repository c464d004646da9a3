"""What the ranks of a ``finalize()`` say to each other, as records, and the
one-rank case.

``finalize()`` runs one pipeline (``ctxreplay.engine.pipeline``) over an
``Exchange``: ``Alone`` here for a single process, where nothing crosses a
wire, or ``ctxreplay.distributed``'s ``RankGroup`` over a
``torch.distributed`` group.  The records both read -- what a rank observed
of a variant (``Observed``), who captures what (``Plan``), what a rank
finalized (``RankResults``) -- live here, so a single process never imports
the distributed machinery.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs
import torch.distributed as dist
from torch import nn

from ..capture.options import CaptureOptions, VariantRequest
from ..capture.results import Capture, CaptureFailure, Notice, Problem
from ..core.probe import ContextProbe
from ..errors import Error

__all__ = ["Alone", "DistributedError", "Exchange", "Observed", "Plan", "RankResults",
           "active_group"]

T = TypeVar("T")

if dist.is_available() and not dist.is_initialized():
    # torch.distributed.nn.functional binds ``group.WORLD`` -- the process group
    # itself, once one exists -- as the default argument of its collectives
    # when it is first imported, and torch._dynamo imports it (through FSDP and
    # sharded tensors).  First imported by a capture, after
    # init_process_group(), it would hold the user's group for the rest of the
    # process: destroy_process_group() would no longer free it, and its gloo
    # threads and sockets would live on into interpreter teardown.  Imported
    # with ctxreplay, while no group exists, its defaults are None (the
    # default group).
    with contextlib.suppress(ImportError):
        import torch.distributed.nn.functional  # noqa: F401


class DistributedError(Error, RuntimeError):
    """A distributed ``finalize()`` cannot proceed: ranks missing, or ranks
    that disagree (``ranks`` names them)."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        """The ranks that are missing or disagree (empty when not known)."""


def active_group(group: Any) -> Any:
    """The process group a finalize is a collective over, or ``None`` for a
    single process: nothing initialised, or no group named and a world of
    one rank.  A group named explicitly is used whatever its size."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise DistributedError("capture_with(group=...): torch.distributed is not "
                                   "initialised in this process")
        return None
    if group is not None:
        return group
    return dist.group.WORLD if dist.get_world_size() > 1 else None


@attrs.frozen
class Observed:
    """What one rank says it observed of one variant (metadata only)."""

    key: str
    scope: str
    index: int  # the rank's own variant number
    calls: int
    members: tuple[tuple[str, int], ...]


@attrs.frozen
class Plan:
    """Who captures what: the same on every rank."""

    owner: dict[str, int]
    observed_on: dict[str, tuple[int, ...]]
    rank_calls: dict[str, tuple[tuple[int, int], ...]]
    members: dict[str, tuple[tuple[str, int], ...]]
    variant: dict[str, int]  # key -> the merged report's variant number, in report order
    scope: dict[str, str]


@attrs.frozen(eq=False)
class RankResults:
    """What one rank finalized, as every rank receives it: its own captures
    (with artifacts on the rank that made them, without elsewhere), its
    failures, the problems and notices of its observation, and its counts."""

    captures: tuple[Capture, ...]
    failures: tuple[CaptureFailure, ...]
    problems: tuple[Problem, ...]
    notices: tuple[Notice, ...]
    errors: dict[tuple[str, str], int]
    dropped: dict[str, int]
    retained: dict[str, int] | None
    requests: int  # variants observed, completed or not
    calls: int  # their calls
    observed: bool  # anything seen: variants, observation errors, compiled calls, scopes
    seconds: float
    explained: tuple[Any, ...] | None = None


class Exchange(Protocol):
    """What ``finalize()`` needs of the other ranks.  One process is the
    one-rank case (``Alone``); a ``torch.distributed`` group is ``RankGroup``."""

    rank: int  # this rank's index in ``ranks``
    ranks: tuple[int, ...]

    def open(self, options: CaptureOptions) -> None:
        """Wait for the other ranks and agree on the probes."""

    def key(self, request: VariantRequest, identity: Any) -> str:
        """The variant's key: the same for the same variant on every rank."""

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` from every rank, in rank order."""

    def plan(self, observed: list[Observed]) -> Plan:
        """Who captures which variant, and its number in the report."""

    def relabel(self, result: Capture | CaptureFailure, key: str, plan: Plan,
                folded: Sequence[str] = ()) -> Capture | CaptureFailure:
        """A result as the merged report names it (``folded``: the keys of
        the variants a folded capture stands for besides its own)."""

    def share(self, mine: RankResults, options: CaptureOptions) -> list[RankResults]:
        """Every rank's results, in rank order (this rank's as they are)."""

    def check_collectives(self, captures: list[Capture], mine: Mapping[str, Capture],
                          modules: Mapping[str, nn.Module],
                          neutral_probes: tuple[ContextProbe[Any], ...],
                          verify: str) -> list[Capture]:
        """Captures whose graphs hold collectives, verified on every rank together."""

    def captures_in_turns(self, work: Callable[[], T], modules: Mapping[str, nn.Module],
                          root: nn.Module) -> T:
        """``work()``: this rank's captures, with the other ranks where
        capturing needs them (gathering FSDP parameters)."""

    def info(self, plan: Plan, every: list[RankResults]) -> dict[str, Any] | None:
        """What the report says of the job (``None``: one process)."""


class Alone:
    """One process: every variant is this rank's, numbered as it was observed,
    and nothing crosses a wire."""

    rank: int = 0
    ranks: tuple[int, ...] = (0,)

    def open(self, options: CaptureOptions) -> None:
        return None

    def key(self, request: VariantRequest, identity: Any) -> str:
        return f"{request.scope}#{request.variant}"

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def plan(self, observed: list[Observed]) -> Plan:
        return Plan(owner={o.key: 0 for o in observed},
                    observed_on={o.key: (0,) for o in observed},
                    rank_calls={o.key: ((0, o.calls),) for o in observed},
                    members={o.key: o.members for o in observed},
                    variant={o.key: o.index for o in observed},
                    scope={o.key: o.scope for o in observed})

    def relabel(self, result: Capture | CaptureFailure, key: str, plan: Plan,
                folded: Sequence[str] = ()) -> Capture | CaptureFailure:
        return result

    def share(self, mine: RankResults, options: CaptureOptions) -> list[RankResults]:
        return [mine]

    def check_collectives(self, captures: list[Capture], mine: Mapping[str, Capture],
                          modules: Mapping[str, nn.Module],
                          neutral_probes: tuple[ContextProbe[Any], ...],
                          verify: str) -> list[Capture]:
        return captures  # a graph that holds collectives needs a group

    def captures_in_turns(self, work: Callable[[], T], modules: Mapping[str, nn.Module],
                          root: nn.Module) -> T:
        return work()

    def info(self, plan: Plan, every: list[RankResults]) -> dict[str, Any] | None:
        return None
