"""Constants that the CUDA headers own, read from the headers shipped in the package, so that no Python module
mirrors one by hand: ``enum(header, name)`` for an ``enum Name : int { kA = 1, ... };`` and
``constant(header, name)`` for a ``constexpr <type> name = <integer>;`` (headers relative to
tokenyard/include/tokenyard)."""

from __future__ import annotations

import functools
import pathlib
import re
from typing import Dict

INCLUDE = pathlib.Path(__file__).resolve().parents[1] / "include" / "tokenyard"


@functools.lru_cache(maxsize=None)
def _text(header: str) -> str:
    return re.sub(r"//[^\n]*", "", (INCLUDE / header).read_text())


def _integer(literal: str) -> int:
    return int(literal.strip().replace("'", ""), 0)


@functools.lru_cache(maxsize=None)
def enum(header: str, name: str) -> Dict[str, int]:
    """``{member: value}`` of an enum whose members all have explicit values."""
    found = re.search(rf"enum\s+{name}\s*:\s*int\s*\{{(.*?)\}}\s*;", _text(header), re.S)
    if found is None:
        raise LookupError(f"no enum {name} in {header}")
    members = {}
    for item in found.group(1).split(","):
        if item.strip():
            member, value = item.split("=")
            members[member.strip()] = _integer(value)
    return members


@functools.lru_cache(maxsize=None)
def constant(header: str, name: str) -> int:
    found = re.search(rf"constexpr\s+[\w:]+\s+{name}\s*=\s*([0-9a-fA-Fx']+)\s*;", _text(header))
    if found is None:
        raise LookupError(f"no constexpr integer {name} in {header}")
    return _integer(found.group(1))
