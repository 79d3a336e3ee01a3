"""JSON that someone else wrote, parsed within stated bounds or refused by name.

A safetensors header and a checkpoint's index come from whoever wrote the checkpoint; a
manifest's `tensorhub.files.left` entry from whoever published the version. `json.loads`
alone turns a deeply nested document into a raw `RecursionError`, a 5,000-digit number into
a raw `ValueError` (Python's limit on int digits), and a 57 MiB header of a million empty
objects into 1.2 GiB of dicts. `load` checks the bounds of `Limits` on the raw bytes first,
each at the speed of a byte scan (no Python loop over the input):

- the size;
- the number of object members (each `:`) and of values (each `{`, `[`, `:` and `,`: every
  key, container and scalar but the outermost follows one), counted on the bytes, those
  inside strings too: an overestimate, so a bound is never passed unseen. With them the
  number of tensors a header can name, and the memory its parse takes, are bounded before
  it is parsed;
- the nesting depth, measured on the brackets outside strings;

then parses, with each integer's digits bounded as it is read. Every refusal is the error
class the caller names (`InvalidArgument` for a file, `InvalidManifest` for a manifest),
with the source in the message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tensorhub.errors import InvalidArgument

MAX_INT_DIGITS = 20  # 2**64 has 20 digits: every size, offset or dimension fits

_BRACKETS_AND_QUOTES = b'[]{}"'
_OTHER_BYTES = bytes(b for b in range(256) if b not in _BRACKETS_AND_QUOTES)
_STRING = re.compile(rb'"[^"]*"')  # on the projection: a string's brackets and quotes


@dataclass(frozen=True)
class Limits:
    """Bounds on one JSON document."""

    max_bytes: int
    max_depth: int  # 1: a flat object; a safetensors header needs 3
    max_members: int  # object members (keys), all objects together
    max_values: int  # keys, containers and scalars together (about: see the module docstring)


def load(
    raw: bytes, what: str, limits: Limits, error: type[InvalidArgument] = InvalidArgument
) -> object:
    """`raw` parsed, or `error` naming `what` and the bound it breaks (see the module
    docstring). The caller still checks the types of what it gets."""
    if len(raw) > limits.max_bytes:
        raise error(f"{what}: {len(raw)} bytes of JSON (at most {limits.max_bytes})")
    members = raw.count(b":")
    values = members + raw.count(b",") + raw.count(b"{") + raw.count(b"[")
    if members > limits.max_members or values > limits.max_values:
        raise error(
            f"{what}: up to {members} keys and {values} values (at most {limits.max_members} "
            f"and {limits.max_values})"
        )
    shape = _brackets(raw)
    if b'"' in shape:
        raise error(f"{what}: not JSON: a string is not closed")
    if 2 * (shape.count(b"{") + shape.count(b"[")) != len(shape):
        raise error(f"{what}: not JSON: its brackets do not balance")
    if not _within_depth(shape, limits.max_depth):
        raise error(
            f"{what}: nested deeper than {limits.max_depth} levels, or its brackets do not pair"
        )

    def bounded_int(text: str) -> int:
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise error(f"{what}: an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
        return int(text)

    try:
        return json.loads(raw, parse_int=bounded_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{what}: not JSON: {exc}") from None
    except RecursionError:  # not reached past the depth check; kept as a named error
        raise error(f"{what}: nested too deeply") from None


def _brackets(raw: bytes) -> bytes:
    """The brackets of `raw` outside its strings, in order (and a quote that closes none).

    Escaped backslashes and quotes are dropped first (JSON pairs backslashes from the left,
    as `replace` does), then everything but brackets and quotes; a string is then a run
    between two quotes, almost always empty (`""`)."""
    shape = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _OTHER_BYTES)
    shape = shape.replace(b'""', b"")
    if b'"' in shape:  # strings holding brackets (rare): drop them whole
        shape = _STRING.sub(b"", shape)
    return shape


def _within_depth(shape: bytes, depth: int) -> bool:
    """Whether `shape` (balanced brackets) nests at most `depth` deep: each pass removes
    the innermost pairs, so `depth` passes empty what nests at most that deep."""
    for _ in range(depth):
        if not shape:
            return True
        shape = shape.replace(b"[]", b"").replace(b"{}", b"")
    return not shape
