"""Artifact formats: how a captured program is written to a file and read back,
and the registry that names them.

A format (:class:`ArtifactFormat`) has a name, which the sidecar records, and a
file suffix; it says whether it can hold an artifact and why not, writes and
reads one, and recognises its files by their content.  ``register_format``
adds one; lookups go by name (``get_format``), by file (``format_of_file``)
and for an artifact (``format_for``).  The torch.export ``.pt2`` is the
built-in one (``pt2``).  The names live in the plugin registry probes and
backends use (``_base.plugins``): an installed package may add a format
through the ``ctxreplay.formats`` entry point, and one that fails to load is
warned about and never breaks the others.
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from .._base.plugins import Registry
from ..errors import Error, Warning

__all__ = ["ENTRY_POINT_GROUP", "ArtifactFormat", "FormatRegistrationWarning",
           "UnknownFormatError", "artifact_bytes", "artifact_from_bytes", "available_formats",
           "format_for", "format_of_file", "get_format", "register_format",
           "unregister_format"]

ENTRY_POINT_GROUP = "ctxreplay.formats"

F = TypeVar("F", bound="type[ArtifactFormat] | ArtifactFormat")

#: what a form of an artifact is, to ``ArtifactFormat.forms``: whether it was
#: lowered, and how to build it
Form = tuple[bool, Callable[[], Any]]


class UnknownFormatError(Error, KeyError, ValueError):
    """No artifact format of that name; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0])


class FormatRegistrationWarning(Warning):
    """An artifact format from an entry point could not be registered."""


class ArtifactFormat(ABC):
    """How a captured program is written to a file and read back.

    Subclass it, set ``name`` and ``suffix``, implement ``can_save``,
    ``save``, ``load`` and ``detect``, and register an instance with
    :func:`register_format`; ``Capture.save`` and ``report.save_all`` then
    write every artifact it can hold, and :func:`ctxreplay.load` reads them
    back.  The other methods have defaults that fit a format whose artifact
    is the callable that runs it.
    """

    name: ClassVar[str]
    """The registry key, recorded in each sidecar (an identifier)."""
    suffix: ClassVar[str]
    """The file suffix ``report.save_all`` gives its files (``".pt2"``)."""

    @property
    def description(self) -> str:
        """A file of this format, in words (``".pt2 archive"``)."""
        return f"{self.suffix} file"

    @abstractmethod
    def can_save(self, artifact: Any) -> str | None:
        """``None`` when this format can hold ``artifact``; otherwise why not, in words."""

    @abstractmethod
    def save(self, artifact: Any, path: Path) -> None:
        """Write ``artifact`` to ``path``."""

    @abstractmethod
    def load(self, path: Path) -> Any:
        """The artifact written to ``path``."""

    def load_bytes(self, data: bytes, name: str) -> Any:
        """The artifact whose file holds ``data`` (``name``: that file, for
        messages): what ``ctxreplay.load`` reads once the file's digest is
        checked, so that the bytes checked are the bytes read.  By default
        ``from_bytes``."""
        return self.from_bytes(data)

    def reload(self, path: Path) -> Any:
        """The artifact just written to ``path``, read back to check the file
        (``Capture.save``); by default ``load``.  A format may read it a
        cheaper way than ``load`` that still goes through its own reader."""
        return self.load(path)

    @abstractmethod
    def detect(self, path: Path) -> bool:
        """Whether the file at ``path`` is one of this format's, by its content."""

    def module(self, artifact: Any) -> Callable[..., Any]:
        """The callable that runs ``artifact`` (by default the artifact itself)."""
        if not callable(artifact):
            raise TypeError(f"{self.name}: {type(artifact).__name__} is not callable")
        return artifact  # type: ignore[no-any-return]

    def forms(self, artifact: Any) -> tuple[Form, ...]:
        """The forms of ``artifact`` to try writing, most preferred first, as
        ``(lowered, build)``; ``Capture.save`` keeps the first the format
        accepts whose file reproduces the live call.  By default the artifact
        as captured."""
        return ((False, lambda: artifact),)

    def same_program(self, written: Any, loaded: Any) -> bool:
        """Whether ``loaded`` (read back from the file) computes what
        ``written`` does, known without running either; ``False`` (the
        default) when the format cannot tell.  Where it is true, a file
        written from the program ``finalize()`` already ran and checked
        needs no run of its own."""
        return False

    def to_bytes(self, artifact: Any) -> bytes:
        """``artifact`` as bytes (by default, the file ``save`` writes)."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"artifact{self.suffix}"
            self.save(artifact, path)
            return path.read_bytes()

    def from_bytes(self, data: bytes) -> Any:
        """The artifact ``to_bytes`` made ``data`` of (by default, through a file)."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"artifact{self.suffix}"
            path.write_bytes(data)
            return self.load(path)

    def program_bytes(self, artifact: Any) -> bytes | None:
        """``artifact`` as bytes *without* the module's weights and buffers
        (what the capture cache keeps; ``program_from_bytes`` is given them
        again); ``None``: this format cannot leave them out, and such
        artifacts are not cached.  By default ``None``."""
        return None

    def program_from_bytes(self, data: bytes, weights: Mapping[str, Any]) -> Any:
        """The artifact ``program_bytes`` made ``data`` of, holding the
        tensors of ``weights`` (by qualified name) -- the same objects, not
        copies; a name it needs and ``weights`` lacks raises ``KeyError``."""
        raise NotImplementedError(f"{self.name}: artifacts are not kept without their weights")

    def check_program_bytes(self, data: bytes) -> None:
        """Raise where ``data`` (``program_bytes``) holds what reading it would
        run, before any of it is used (the capture cache asks at a hit whose
        program is rebuilt later); by default nothing is checked."""
        return None


def _register_entry_point(ep: metadata.EntryPoint, obj: object) -> None:
    instance: Any = obj() if isinstance(obj, type) else obj
    if not isinstance(instance, ArtifactFormat):
        raise TypeError(f"{ep.value} is not an ArtifactFormat class or instance")
    if getattr(instance, "name", None) != ep.name:
        raise ValueError(f"entry point {ep.name!r} loads a format named "
                         f"{getattr(instance, 'name', None)!r}")
    register_format(instance)


_FORMATS: Registry[ArtifactFormat] = Registry(
    "artifact format", ENTRY_POINT_GROUP, builtin_prefix=__name__.rpartition(".")[0] + ".",
    unknown=UnknownFormatError, warning=FormatRegistrationWarning,
    register_entry_point=_register_entry_point)


def register_format(fmt: F, *, replace: bool = False) -> F:
    """Register an artifact format: an ``ArtifactFormat`` subclass
    (instantiated with no arguments) or instance.  Usable as a class
    decorator.

    Args:
        fmt: the format.
        replace: replace a format already registered under the same name or
            suffix (otherwise that is refused).

    Returns:
        Its argument, so a decorated class stays a class.
    """
    instance = fmt() if isinstance(fmt, type) else fmt
    if not isinstance(instance, ArtifactFormat):
        raise TypeError(f"expected an ArtifactFormat subclass or instance, got {fmt!r}")
    name, suffix = getattr(instance, "name", None), getattr(instance, "suffix", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"format name must be an identifier, got {name!r} from {fmt!r}")
    if not isinstance(suffix, str) or not suffix.startswith(".") or len(suffix) < 2:
        raise ValueError(f"format suffix must be '.' and a name, got {suffix!r} from {fmt!r}")
    with _FORMATS._lock:  # one suffix per format, checked and changed together
        entries, _ = _FORMATS.listing()
        taken = [n for n, e in entries.items() if n == name or e.value.suffix == suffix]
        if taken and not replace:
            raise ValueError(f"format {taken[0]!r} already has the name {name!r} or the "
                             f"suffix {suffix!r}; pass replace=True to replace it")
        for other in taken:
            if other != name:
                _FORMATS.remove(other)
        _FORMATS.add(name, instance, type(instance).__module__, replace=replace)
    return fmt


def unregister_format(name: str) -> ArtifactFormat:
    """Remove a format by name and return it."""
    return _FORMATS.remove(name)


def get_format(name: str) -> ArtifactFormat:
    """The registered format called ``name``; an unknown name lists the known ones."""
    return _FORMATS.get(name)


def available_formats() -> Mapping[str, ArtifactFormat]:
    """Every registered format by name, in registration order (the built-in first)."""
    entries, _ = _FORMATS.listing()
    return {n: e.value for n, e in entries.items()}


def format_of_file(path: Path) -> ArtifactFormat | None:
    """The format whose file ``path`` is, by its content (``None``: none).  The
    formats registered last are asked first: a format added later usually
    checks more narrowly than the built-in one (a ``.pt2`` is any zip
    archive)."""
    for fmt in reversed(list(available_formats().values())):
        if fmt.detect(path):
            return fmt
    return None


def format_for(artifact: Any, path: Path | None = None) -> tuple[ArtifactFormat | None, str]:
    """``(format, "")``: the format to write ``artifact`` in -- the one whose
    suffix ends ``path``'s name, else the first registered that can hold it;
    ``(None, why)`` where that one cannot (``why``: "cannot be written as
    ..."), or none can."""
    formats = available_formats().values()
    named = [f for f in formats if path is not None and path.name.endswith(f.suffix)]
    if named:
        reason = named[0].can_save(artifact)
        if reason is None:
            return named[0], ""
        return None, f"cannot be written as a {named[0].suffix} ({reason})"
    reasons = []
    for fmt in formats:
        reason = fmt.can_save(artifact)
        if reason is None:
            return fmt, ""
        reasons.append(f"{fmt.name}: {reason}")
    return None, f"cannot be written in any artifact format ({'; '.join(reasons)})"


def artifact_bytes(artifact: Any) -> bytes:
    """``artifact`` as bytes that name its format, for another process to
    rebuild with :func:`artifact_from_bytes`."""
    fmt, why = format_for(artifact)
    if fmt is None:
        raise TypeError(f"a {type(artifact).__name__} artifact {why}")
    return fmt.name.encode() + b"\0" + fmt.to_bytes(artifact)


def artifact_from_bytes(data: bytes) -> Any:
    """The artifact :func:`artifact_bytes` made ``data`` of."""
    name, _, body = data.partition(b"\0")
    return get_format(name.decode()).from_bytes(body)
