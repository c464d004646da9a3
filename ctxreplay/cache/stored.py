"""What a capture-cache entry's record says of its capture: the program's
metadata (``ProgramMeta``, through its one codec) and what the cache adds
to it -- the artifact format that holds the program, whether the program
returns its outputs flattened, the probes it carries, the verify level it
was stored at.  Metadata only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .._base.jsonread import read_bool, read_list, read_mapping, read_str
from ..artifacts.program import PROGRAM_KEYS, ProgramFields, ProgramMeta

__all__ = ["Stored"]

#: the record's ``capture`` keys beside the program's
_OWN_KEYS = ("format", "flatten_out", "carried")

#: program fields a record may lack: a record written before them reads them
#: as not known (none of them is what a hit is checked against)
_LATER_KEYS = {"output_roles", "baked"}


@attrs.frozen
class Stored(ProgramFields):
    """An entry's record of its capture (metadata only)."""

    format: str
    """The artifact format that holds the program without weights."""
    flatten_out: bool
    """The program returns the call's output leaves, flattened."""
    carried: tuple[str, ...]
    """Probes whose state the program carries (embedded, or pinned into it)."""
    verify: str
    """The verify level the capture passed when it was stored."""
    meta: ProgramMeta
    """The program's metadata, as every document of a capture records it."""

    @classmethod
    def read(cls, doc: Mapping[str, Any]) -> Stored:
        """The record ``doc`` (an entry's whole record) holds; ``ValueError``
        naming the first malformed or missing field.  Every program field
        is required, but for those added later (``_LATER_KEYS``): a hit is
        checked against them."""
        record = read_mapping(doc, "$", required={"capture", "about"})
        c = read_mapping(record["capture"], "$.capture",
                         required={*_OWN_KEYS, *PROGRAM_KEYS} - _LATER_KEYS)
        about = read_mapping(record["about"], "$.about", required={"verify"})
        return cls(
            format=read_str(c["format"], "$.capture.format"),
            flatten_out=read_bool(c["flatten_out"], "$.capture.flatten_out"),
            carried=tuple(read_str(v, f"$.capture.carried[{i}]") for i, v in
                          enumerate(read_list(c["carried"], "$.capture.carried"))),
            verify=read_str(about["verify"], "$.about.verify"),
            meta=ProgramMeta.from_json(c, "$.capture"))

    def to_json(self) -> dict[str, Any]:
        """The record's ``capture`` document (the verify level is written in
        its ``about``); a later field not known is left out, as a record
        written before it has it."""
        program = {k: v for k, v in self.meta.to_json().items()
                   if k not in _LATER_KEYS or v is not None}
        return {"format": self.format, "flatten_out": self.flatten_out,
                "carried": list(self.carried), **program}
