"""ContextSnapshot: the states of a set of probes at one moment."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import attrs

from .._base.jsonread import key_path, read_bool, read_mapping, read_str
from ..errors import Warning
from . import registry
from .probe import ContextProbe, NotPortableError, composed

__all__ = ["DECODE_MODES", "SCHEMA", "ContextSnapshot", "ProbeDiff", "UnknownProbe",
           "UnknownProbeWarning", "UnknownState", "Unresolved", "describe_state"]

SCHEMA = "ctxreplay.snapshot/1"

#: ``from_json(unknown=...)``: refuse a probe this process does not have, or
#: load its state as an opaque placeholder
DECODE_MODES = ("error", "opaque")


@attrs.frozen
class Unresolved:
    """A state that could not be carried (its probe is not portable)."""

    probe: str
    state_type: str


@attrs.frozen
class UnknownState(Unresolved):
    """The state of a probe this process does not have (``from_json(...,
    unknown="opaque")``): kept as the document wrote it -- ``state`` is its
    canonical JSON, ``""`` when it was not portable -- never replayed."""

    state: str = ""


class UnknownProbeWarning(Warning):
    """A document named probes this process does not have; their states were
    loaded as opaque placeholders that cannot be replayed."""


class UnknownProbe(ContextProbe[Any]):
    """Stands in for a probe a document names and this process does not have.

    It cannot observe or replay anything; it writes the state it was read
    with back unchanged, so a document passes through this process intact."""

    portable = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.description = "a probe this process does not have"

    def observe(self) -> Any:
        raise LookupError(f"probe {self.name!r} is not registered in this process")

    def replay(self, state: Any) -> AbstractContextManager[None]:
        raise LookupError(f"probe {self.name!r} is not registered in this process; "
                          "its state cannot be replayed")

    def encode(self, state: Any) -> Any:
        if isinstance(state, UnknownState) and state.state:
            return json.loads(state.state)
        raise NotPortableError(self.name)

    def describe(self, state: Any) -> str:
        return "<unknown probe>"


@attrs.frozen
class ProbeDiff:
    """One probe whose state differs between two snapshots (``None``: absent)."""

    probe: str
    """The probe's name."""
    left: str | None
    """Its state in the first snapshot, in words (``None``: absent there)."""
    right: str | None
    """Its state in the other snapshot, in words (``None``: absent there)."""


@attrs.frozen(cache_hash=True)
class ContextSnapshot:
    """States of the active probes, in replay order (sorted by probe name).

    Hashable and comparable by probe names and states; it is part of every
    variant key.  ``replay()`` re-establishes all states in one ``ExitStack``.
    """

    names: tuple[str, ...]
    """The probes' names, sorted (the replay order)."""
    states: tuple[Any, ...]
    """One state per probe, in the order of ``names``."""
    probes: tuple[ContextProbe[Any], ...] = attrs.field(eq=False, repr=False)
    """The probe objects, in the order of ``names``."""

    def __attrs_post_init__(self) -> None:
        if not (len(self.names) == len(self.states) == len(self.probes)):
            raise ValueError("names, states and probes must have one entry each")

    # -- access -------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        try:
            return self.states[self.names.index(name)]
        except ValueError:
            raise KeyError(f"no probe {name!r} in this snapshot; it has {list(self.names)}") \
                from None

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def items(self) -> Iterator[tuple[str, Any]]:
        """``(probe name, state)`` pairs, in replay order."""
        return zip(self.names, self.states)

    @property
    def unresolved(self) -> tuple[str, ...]:
        """Probes whose state could not be carried from a document (unknown
        probes included)."""
        return tuple(n for n, s in self.items() if isinstance(s, Unresolved))

    @property
    def unknown(self) -> tuple[str, ...]:
        """Probes the document named that this process does not have."""
        return tuple(n for n, s in self.items() if isinstance(s, UnknownState))

    def describe(self) -> dict[str, str]:
        """Probe name -> short human-readable state."""
        return {n: describe_state(p, s) for n, p, s in zip(self.names, self.probes, self.states)}

    def without(self, *names: str) -> ContextSnapshot:
        """The same snapshot with some probes left out."""
        keep = [i for i, n in enumerate(self.names) if n not in names]
        return ContextSnapshot(
            tuple(self.names[i] for i in keep),
            tuple(self.states[i] for i in keep),
            tuple(self.probes[i] for i in keep),
        )

    # -- replay -------------------------------------------------------------
    def _check_resolved(self) -> None:
        unknown = self.unknown
        if unknown:
            raise ValueError(
                f"cannot replay: probe(s) {', '.join(unknown)} are not registered in this "
                "process; register them, or pass instances to from_json(probes=...)")
        bad = self.unresolved
        if bad:
            raise ValueError(
                f"cannot replay: the state of {', '.join(bad)} was not portable "
                "and is missing; observe it again or pass the live probe"
            )

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Establish every state; restore exactly what was there on exit."""
        self._check_resolved()
        with ExitStack() as stack:
            for probe, state in zip(self.probes, self.states):
                stack.enter_context(probe.replay(state))
            yield

    def replay_parts(
        self, *, embedded: bool = True
    ) -> tuple[Callable[[], AbstractContextManager[Any]], AbstractContextManager[None],
               tuple[str, ...], tuple[str, ...]]:
        """Split the replay for a capture.

        Returns ``(inside, around, inside_names, around_names)``: ``inside()``
        makes a fresh context, not yet entered, to enter inside the traced
        callable (each call; nested ``with`` statements instead of an
        ``ExitStack`` while a Dynamo that cannot trace one traces it),
        ``around`` is entered once around the capture, and the names list the
        probes that contributed to each part.  With ``embedded=False``
        everything is around.
        """
        self._check_resolved()
        if not embedded:
            return _null_stack, self.replay(), (), self.names
        pairs = [(p, s, p.split_replay(s)) for p, s in zip(self.probes, self.states)]
        inside_names = tuple(p.name for p, _, (i, _a) in pairs if i is not None)
        around_names = tuple(p.name for p, _, (_i, a) in pairs if a is not None)
        arounds = [a for _, _, (_i, a) in pairs if a is not None]
        inside_items = [(p, s) for p, s, (i, _a) in pairs if i is not None]

        def inside() -> AbstractContextManager[None]:
            # If one probe's part fails, composed() unwinds the parts already
            # entered then: an abandoned generator context would restore its
            # "before" state whenever it is garbage-collected -- long after
            # the capture.
            return composed([functools.partial(_inside_part, p, s) for p, s in inside_items])

        @contextmanager
        def around() -> Iterator[None]:
            with ExitStack() as stack:
                for cm in arounds:
                    stack.enter_context(cm)
                yield

        # The inside parts built for splitting were never entered; build fresh ones.
        return inside, around(), inside_names, around_names

    # -- comparison ---------------------------------------------------------
    def diff(self, other: ContextSnapshot) -> tuple[ProbeDiff, ...]:
        """What differs, probe by probe (probes present in only one side included)."""
        mine = dict(zip(self.names, zip(self.probes, self.states)))
        theirs = dict(zip(other.names, zip(other.probes, other.states)))
        out = []
        for name in sorted(set(mine) | set(theirs)):
            a, b = mine.get(name), theirs.get(name)
            if a is not None and b is not None and a[1] == b[1]:
                continue
            out.append(ProbeDiff(
                name,
                None if a is None else describe_state(*a),
                None if b is None else describe_state(*b),
            ))
        return tuple(out)

    # -- JSON ---------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict.  A state that is not portable is marked, not dropped."""
        probes: dict[str, Any] = {}
        for name, probe, state in zip(self.names, self.probes, self.states):
            if isinstance(state, UnknownState) and state.state:
                probes[name] = {"portable": True, "state": json.loads(state.state)}
                continue
            if isinstance(state, Unresolved):
                probes[name] = {"portable": False, "type": state.state_type}
                continue
            try:
                if not probe.portable:
                    raise NotPortableError(name)
                data = probe.encode(state)
                json.dumps(data, allow_nan=False)  # what is not plain JSON is not carried
            except Exception:  # a user's encoder may raise anything
                # NotPortableError -- or an encoder that fails or returns
                # something JSON cannot hold: that state is marked, the
                # document (and the capture or report building it) still made.
                probes[name] = {"portable": False, "type": type(state).__name__}
            else:
                probes[name] = {"portable": True, "state": data}
        return {"schema": SCHEMA, "probes": probes}

    @classmethod
    def from_json(
        cls,
        data: object,
        probes: Iterable[ContextProbe[Any]] | Mapping[str, ContextProbe[Any]] | None = None,
        *,
        path: str = "$",
        unknown: str = "error",
    ) -> ContextSnapshot:
        """Rebuild a snapshot from ``to_json()`` output, validating every field.

        ``probes`` supplies instances for names the registry does not hold (a
        user's forward-context probe).  Any malformed input raises
        ``ValueError`` naming the path; nothing is executed or unpickled.
        ``unknown``: ``"error"`` refuses a probe name neither the registry nor
        ``probes`` holds; ``"opaque"`` loads its state as an
        :class:`UnknownState` of an :class:`UnknownProbe` (listed by
        ``.unknown``; it cannot be replayed, and is written back unchanged).
        Its state is still checked to be plain JSON, and bounded.
        """
        if unknown not in DECODE_MODES:
            raise ValueError(f"unknown: {unknown!r} is not one of {list(DECODE_MODES)}")
        doc = read_mapping(data, path, keys={"schema", "probes"}, required={"schema", "probes"})
        schema = read_str(doc["schema"], f"{path}.schema")
        if schema != SCHEMA:
            raise ValueError(f"{path}.schema: unsupported schema {schema!r}; expected {SCHEMA!r}")
        given: dict[str, ContextProbe[Any]] = {}
        if isinstance(probes, Mapping):
            given = dict(probes)
        elif probes is not None:
            given = {p.name: p for p in probes}
        entries = read_mapping(doc["probes"], f"{path}.probes")
        names, states, insts = [], [], []
        for name in sorted(entries):
            where = key_path(f"{path}.probes", name)
            probe = given.get(name)
            if probe is None:
                if where != f"{path}.probes.{name}":
                    # not a name the registry can hold: refused without echoing it
                    raise ValueError(f"{where}: unknown probe; known probes: "
                                     f"{', '.join(sorted(registry.available_probes()))}")
                try:
                    probe = registry.get_probe(name)
                except registry.UnknownProbeError as exc:
                    if unknown == "error":
                        raise ValueError(f"{where}: {exc}") from None
                    probe = UnknownProbe(name)
            entry = read_mapping(entries[name], where, keys={"portable", "state", "type"},
                                 required={"portable"})
            state: Any
            if isinstance(probe, UnknownProbe):
                state = _unknown_state(name, entry, where)
            elif read_bool(entry["portable"], f"{where}.portable"):
                if "state" not in entry:
                    raise ValueError(f"{where}.state: missing required field")
                try:
                    state = probe.decode(entry["state"], f"{where}.state")
                except ValueError as exc:
                    if str(exc).startswith(path):
                        raise
                    # a decoder that names no path: this one, and not its text
                    raise ValueError(
                        f"{where}.state: could not be decoded ({type(exc).__name__})"
                    ) from None
                except Exception as exc:  # a probe's decoder must not leak other types
                    raise ValueError(
                        f"{where}.state: could not be decoded ({type(exc).__name__})"
                    ) from None
            else:
                state = Unresolved(name, read_str(entry.get("type", "?"), f"{where}.type"))
            names.append(name)
            states.append(state)
            insts.append(probe)
        return cls(tuple(names), tuple(states), tuple(insts))


_MAX_UNKNOWN_STATE = 4096  # characters of an unknown probe's state kept verbatim


def _unknown_state(name: str, entry: Any, where: str) -> UnknownState:
    if not read_bool(entry["portable"], f"{where}.portable"):
        return UnknownState(name, read_str(entry.get("type", "?"), f"{where}.type"))
    if "state" not in entry:
        raise ValueError(f"{where}.state: missing required field")
    try:
        text = json.dumps(entry["state"], sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        raise ValueError(f"{where}.state: expected plain JSON") from None
    if len(text) > _MAX_UNKNOWN_STATE:
        raise ValueError(f"{where}.state: longer than {_MAX_UNKNOWN_STATE} characters")
    return UnknownState(name, "unknown", text)


def describe_state(probe: ContextProbe[Any], state: Any) -> str:
    """``probe.describe(state)`` as one short printable line; never raises."""
    if isinstance(state, UnknownState):
        return "<unknown probe>"
    if isinstance(state, Unresolved):
        return f"<not portable: {state.state_type}>"
    try:
        text = str(probe.describe(state))
    except Exception as exc:  # describing is for humans; never fatal
        return f"<undescribable: {type(exc).__name__}>"
    # It lands in reports: one short line, whatever a third-party probe returns.
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= _MAX_DESCRIBE else text[:_MAX_DESCRIBE - 3] + "..."


_MAX_DESCRIBE = 80


def _null_stack() -> AbstractContextManager[None]:
    return nullcontext()


def _inside_part(probe: ContextProbe[Any], state: Any) -> AbstractContextManager[None] | None:
    return probe.split_replay(state)[0]
