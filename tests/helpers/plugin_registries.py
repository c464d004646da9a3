"""The plugin registries (probes, backends) as the suite sees them: what each
holds, for the leak oracle in ``conftest.py``, and the ``fake_dist`` fixture,
real on-disk distributions whose entry points the registries load.  ``conftest.py``
imports the fixture, so every test module has it.
"""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

from ctxreplay._base.plugins import Registry
from ctxreplay.artifacts import available_formats
from ctxreplay.artifacts import formats as format_registry
from ctxreplay.backends import available_backends
from ctxreplay.backends import registry as backend_registry
from ctxreplay.core import registry as probe_registry
from ctxreplay.probes import available_probes

#: what a failure calls each registry -> (its public listing, its table)
REGISTRIES: dict[str, tuple[Callable[[], Mapping[str, Any]], Registry[Any]]] = {
    "probe registry": (available_probes, probe_registry._PROBES),
    "backend registry": (available_backends, backend_registry._BACKENDS),
    "artifact format registry": (available_formats, format_registry._FORMATS),
}

#: name -> (public info, the very object registered, or None for an entry point's)
Held = dict[str, tuple[Any, object]]


def registered() -> dict[str, Held]:
    """What each registry holds now.  A built-in or runtime registration is
    known by the very object registered as well as its info; an entry point's
    by its info alone, since loading entry points again (after a test's
    ``fake_dist``) instantiates a probe class afresh."""
    out: dict[str, Held] = {}
    for what, (listing, table) in REGISTRIES.items():
        entries, _ = table.listing()
        out[what] = {}
        for name, info in listing().items():
            if hasattr(info, "inactive"):
                # whether a framework a probe reads is imported yet (a test
                # that imports diffusers) is not the registry's state
                info = attrs.evolve(info, inactive=None)
            entry = entries.get(name)
            kept = None if entry is None or entry.origin == "entry_point" else entry.value
            out[what][name] = (info, kept)
    return out


def registry_changes(before: dict[str, Held], after: dict[str, Held]) -> list[str]:
    """One line per registry whose names or registrations differ."""
    problems = []
    for what in REGISTRIES:
        old, new = before[what], after[what]
        added = sorted(set(new) - set(old))
        removed = sorted(set(old) - set(new))
        changed = sorted(n for n in set(old) & set(new)
                         if old[n][0] != new[n][0] or old[n][1] is not new[n][1])
        if added or removed or changed:
            problems.append(f"{what}: added {added}, removed {removed}, changed {changed}")
    return problems


def reset_entry_points() -> None:
    """Every registry forgets its entry points and loads them again when next asked."""
    for _, table in REGISTRIES.values():
        table.reset_entry_points()


MakeDist = Callable[..., Path]


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeDist]:
    """Build real on-disk distributions (``*.dist-info`` with METADATA and
    ``entry_points.txt``) on ``sys.path``; the registries forget them after.

    ``make(name, entry_points, files, group="ctxreplay.probes")``: entry point
    name -> ``module:attr`` in ``group``, and module -> source; ``{t}`` in a
    module name or target is a per-test token, so modules never collide."""
    modules: list[str] = []
    token = uuid.uuid4().hex[:8]

    def make(name: str, entry_points: dict[str, str], files: dict[str, str],
             group: str = probe_registry.ENTRY_POINT_GROUP) -> Path:
        root = tmp_path / f"site_{name}"
        info = root / f"{name}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
        lines = [f"{ep} = {target.format(t=token)}" for ep, target in entry_points.items()]
        (info / "entry_points.txt").write_text(f"[{group}]\n" + "\n".join(lines) + "\n")
        for module, source in files.items():
            module = module.format(t=token)
            modules.append(module)
            (root / f"{module}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(root))
        reset_entry_points()
        return root

    reset_entry_points()
    try:
        yield make
    finally:
        monkeypatch.undo()
        for module in modules:
            sys.modules.pop(module, None)
        reset_entry_points()
