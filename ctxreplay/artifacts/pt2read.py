"""A ``.pt2`` archive read with nothing in it run: every tensor payload
through ``torch.load(weights_only=True)`` or as raw bytes, the graph as
JSON by torch's own schema deserialiser.

``torch.export.load`` unpickles parts of the archive with
``weights_only=False`` -- in torch 2.7 every payload
(``serialize.deserialize_torch_artifact``); from the ``pt2_archive`` layout
on (torch 2.8+) a tensor subclass's weight or constant, every custom
(TorchBind) and opaque object constant (``torch._C._pickle_load_obj``,
``pickle.loads``), and the sample inputs wherever the ``weights_only`` read
fails (it falls back) -- so a file can run any code at load.  Here a
payload that needs more than tensors is refused (``UnsafeFileError``
naming the file and the archive member), and the program is rebuilt with
``ExportedProgramDeserializer`` from the tensors already read (torch's
deserialiser passes a ``dict`` or ``tuple`` through unread).

Both layouts ``torch.export.save`` writes are read: the ``pt2_archive``
one (``archive_format``, ``models/model.json``, ``data/weights/``,
``data/constants/``, ``data/sample_inputs/model.pt``) where this torch
has that package, and the earlier one torch 2.7 writes
(``serialized_exported_program.json`` and three pickled ``.pt`` files).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import io
import json
import os
import pickle
import types
import typing
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._base.safefiles import UnsafeFileError

__all__ = ["decode", "read_program", "tensor_payload"]

_LEGACY_PROGRAM = "serialized_exported_program.json"
_LEGACY_PAYLOADS = ("serialized_state_dict.pt", "serialized_constants.pt",
                    "serialized_example_inputs.pt")


def read_program(data: bytes, name: str) -> Any:
    """The ``torch.export.ExportedProgram`` the archive ``data`` holds
    (``name``: the file, for messages).  ``UnsafeFileError``: a payload
    needs more than tensors; ``ValueError``: not an archive this reads."""
    try:
        members = zipfile.ZipFile(io.BytesIO(data)).namelist()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ValueError(f"{name}: not a readable .pt2 archive ({exc}): truncated or "
                         "damaged") from None
    if _LEGACY_PROGRAM in members:
        return _read_legacy(data, name)
    if any(m.endswith("/archive_format") or m == "archive_format" for m in members):
        return _read_pt2_archive(data, name)
    raise ValueError(f"{name}: a zip archive that is not a torch.export program")


def tensor_payload(data: bytes, where: str, *, one: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a payload: a tensor (``one``), or a
    ``dict`` / ``tuple`` of them; refused where it needs more."""
    if not data:
        return {}
    try:
        value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise UnsafeFileError(f"{where}: holds more than tensors ({_named_global(exc)}); "
                              "refused: unpickling it would run code it names (a class you "
                              "trust is read once given to "
                              "torch.serialization.add_safe_globals)") from None
    except Exception as exc:  # torch.load may raise anything: a ValueError
        raise ValueError(f"{where}: unreadable ({type(exc).__name__}: "
                         f"{str(exc)[:160]})") from None
    expected: tuple[type, ...] = (torch.Tensor,) if one else (dict, tuple)
    if not isinstance(value, expected):
        raise ValueError(f"{where}: holds a {type(value).__name__}, expected "
                         f"{'a tensor' if one else 'a dict or tuple of tensors'}")
    return value


def _named_global(exc: Exception) -> str:
    """What torch's ``weights_only`` unpickler refused, in a few words: its
    ``Unsupported global: GLOBAL module.name ...`` line where it names one."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln]
    shown = (named or lines or ["an object torch's weights_only reader refuses"])[0]
    return shown.split(" was not an allowed global")[0][:200]


def _deserialize(serialized: Any, state: Any, constants: Any, inputs: Any) -> Any:
    from torch._export.serde.serialize import ExportedProgramDeserializer

    return ExportedProgramDeserializer(None).deserialize(serialized, state, constants,
                                                         inputs or None)


def _read_legacy(data: bytes, name: str) -> Any:
    """The layout torch 2.7 writes: the program's JSON and three ``torch.save`` payloads."""
    from torch._export.serde.schema import ExportedProgram as Schema
    from torch._export.serde.serialize import _dict_to_dataclass

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        members = set(z.namelist())
        missing = [m for m in _LEGACY_PAYLOADS if m not in members]
        if missing:
            raise ValueError(f"{name}: {missing[0]} is missing from the archive")
        state, constants, inputs = (tensor_payload(z.read(m), f"{name}: {m}")
                                    for m in _LEGACY_PAYLOADS)
        program = json.loads(z.read(_LEGACY_PROGRAM))
    return _deserialize(_dict_to_dataclass(Schema, program),  # type: ignore[no-untyped-call]
                        state, constants, inputs)


def _read_pt2_archive(data: bytes, name: str) -> Any:
    """The ``pt2_archive`` layout, read as ``pt2_archive._package`` reads one
    program, each payload through ``_payloads``."""
    from torch._export.serde.schema import ExportedProgram as Schema
    try:  # (by name: torch 2.7 has no such package, and its stubs none either)
        pkg: Any = importlib.import_module("torch.export.pt2_archive._package")
        names: Any = importlib.import_module("torch.export.pt2_archive.constants")
    except ImportError:
        raise ValueError(f"{name}: written in torch's pt2_archive layout, which torch "
                         f"{torch.__version__} cannot read") from None
    try:
        reader = pkg.PT2ArchiveReader(io.BytesIO(data))
        version = reader.read_string(names.ARCHIVE_VERSION_PATH)
    except Exception as exc:  # torch's reader may raise anything: a ValueError
        raise ValueError(f"{name}: not a readable .pt2 archive ({type(exc).__name__})") \
            from None
    if version != names.ARCHIVE_VERSION_VALUE:
        raise ValueError(f"{name}: archive version {version!r}; this torch reads "
                         f"{names.ARCHIVE_VERSION_VALUE!r}")
    model = names.MODELS_FILENAME_FORMAT.format("model")
    files = reader.get_file_names()
    programs = [n for n in files if n.startswith(names.MODELS_DIR)]
    if programs != [model]:
        raise ValueError(f"{name}: holds the programs {programs}; a saved capture holds "
                         f"one, {model}")
    serialized = decode(Schema, json.loads(reader.read_bytes(model)))
    sample = names.SAMPLE_INPUTS_FILENAME_FORMAT.format("model")
    inputs = tensor_payload(reader.read_bytes(sample), f"{name}: {sample}") if sample in files \
        else None
    state = _payloads(pkg, names, reader, name, constants=False)
    constants = _payloads(pkg, names, reader, name, constants=True)
    return _deserialize(serialized, state, constants, inputs)


def _payloads(pkg: Any, names: Any, reader: Any, name: str, *,
              constants: bool) -> dict[str, Any]:
    """The weights (or constants) of the archive: raw payloads as torch's
    ``_build_file_map`` reads them (bytes into a storage, no unpickling),
    pickled ones through ``_tensors``; an object constant is refused."""
    base = names.CONSTANTS_DIR if constants else names.WEIGHTS_DIR
    legacy = f"{base}model.pt"
    files = reader.get_file_names()
    if legacy in files:
        return dict(tensor_payload(reader.read_bytes(legacy), f"{name}: {legacy}"))
    fmt = names.CONSTANTS_CONFIG_FILENAME_FORMAT if constants else \
        names.WEIGHTS_CONFIG_FILENAME_FORMAT
    config_file = fmt.format("model")
    if config_file not in files:
        raise ValueError(f"{name}: {config_file} is missing from the archive")
    config = pkg._load_payload_config(reader, config_file)
    raw = pkg._build_file_map(reader, config, base)
    out: dict[str, Any] = {}
    for fqn, meta in config.config.items():
        member = os.path.join(base, meta.path_name)
        if constants and not meta.path_name.startswith(names.TENSOR_CONSTANT_FILENAME_PREFIX):
            raise UnsafeFileError(f"{name}: {member} holds a Python object ({fqn}), not a "
                                  "tensor; refused: unpickling it would run code it names")
        if meta.use_pickle:
            out[fqn] = tensor_payload(reader.read_bytes(member), f"{name}: {member}", one=True)
            continue
        out[fqn] = _strided(raw[meta.path_name], meta, param=not constants and meta.is_param)
    return out


def _strided(flat: torch.Tensor, meta: Any, *, param: bool) -> torch.Tensor:
    # (the readers of a raw payload's metadata came with that layout: torch
    # 2.7's serializer has none, and its files never reach here)
    serde: Any = importlib.import_module("torch._export.serde.serialize")
    tm = meta.tensor_meta
    if tm is None:
        raise ValueError(f"{meta.path_name}: a raw payload without its tensor metadata")
    t = torch.as_strided(flat, size=serde.deserialize_size(tm.sizes),
                         stride=serde.deserialize_stride(tm.strides),
                         storage_offset=serde.deserialize_storage_offset(tm.storage_offset))
    return nn.Parameter(t, requires_grad=tm.requires_grad) if param else t


# -- the graph's JSON, decoded ----------------------------------------------------

@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    from torch._export.serde import schema

    return typing.get_type_hints(cls, globalns=vars(schema))


def decode(cls: Any, data: Any) -> Any:
    """torch's JSON-to-schema decoding (``serialize._dict_to_dataclass``),
    by a decoder made once per schema type (``_decoder``) instead of
    resolving each class's type hints at every node -- most of what
    loading a small program costs."""
    return _decoder(cls)(data)


_Decoder = Callable[[Any], Any]


@functools.cache
def _decoder(cls: Any) -> _Decoder:
    """The decoder of one schema type, as ``serialize._dict_to_dataclass``
    decodes it: an optional's ``None`` stays ``None``; a union (one key:
    its member's name) is made with ``create``; a dataclass from the fields
    the data has (torch ignores unknown keys); a list or dict by its data,
    element by element; a float is made a float.  Nested types are looked
    up when first met, so recursive schema types need no special case."""
    from torch._export.serde import schema
    from torch._export.serde.union import _Union

    if isinstance(cls, typing.ForwardRef):
        return _decoder(cls.__forward_arg__)
    if isinstance(cls, str):
        return _decoder(getattr(schema, cls))
    origin = typing.get_origin(cls)
    if origin is typing.Annotated:
        return _decoder(cls.__origin__)
    args = typing.get_args(cls)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        return lambda data: None if data is None else _decoder(args[0])(data)
    if isinstance(cls, type) and issubclass(cls, _Union):
        return _union_decoder(cls)
    if dataclasses.is_dataclass(cls):
        hints = _hints(cls)  # type: ignore[arg-type]
        fields = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
        return lambda data: cls(**{name: _decoder(hint)(data[name])  # type: ignore[operator]
                                   for name, hint in fields if name in data})
    return functools.partial(_plain, cls, args)


def _union_decoder(cls: Any) -> _Decoder:
    hints = _hints(cls)
    create = cls.create

    def union(data: Any) -> Any:
        (name, value), = data.items()
        return create(**{name: _decoder(hints[name])(value)})
    return union


def _plain(cls: Any, args: tuple[Any, ...], data: Any) -> Any:
    if isinstance(data, list):
        if not data:
            return data
        item = _decoder(args[0])
        return [item(d) for d in data]
    if isinstance(data, dict):
        value = _decoder(args[1])
        return {k: value(v) for k, v in data.items()}
    return float(data) if cls is float else data
