"""The NIXL control channel: the TCP connection over which a reader gets a holder's NIXL
agent metadata and memory regions, and brackets each READ it makes.

A holder that serves NIXL listens on a TCP port of its own. One connection per (reader,
holder, version):

1. reader → holder: a `NixlRequest` (tenant, model, version, layout digest, read token);
2. holder → reader: after the token is checked (`transport.verifier.lookup`), a `NixlOffer`:
   its agent's metadata and one `(address, length)` region per layout tensor; or a refusal
   with a `transport.wire.ErrorCode`, which the reader turns into a typed `ChunkOutcome`;
3. for each batch of chunks: reader → holder `begin` with its read token as it is now;
   holder → reader, once the token passes `lookup` again, `go` (the read is now counted in
   `HeldVersion.reading()`, so a release waits for it) or a refusal (`DENIED`, `RELEASED`);
   the reader READs the batch with NIXL; reader → holder `end` (no answer);
4. the reader closes the connection, or the holder does once the version is released.

Nothing of this goes to etcd: the holder record names only the control port. Each message is
a u32 big-endian length and that many bytes of UTF-8 JSON tagged with `FORMAT`
(`transport.frames`). Descriptors travel as plain integers, never pickled: a reader must not
run code a holder sent.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from tensorhub.errors import TransportError
from transport.frames import decode_json
from transport.wire import ErrorCode, Refusal

FORMAT = "tensorhub-nixl/1"
MAX_REQUEST_BYTES = 64 * 1024
MAX_OFFER_BYTES = 64 * 1024 * 1024  # agent metadata (every backend's connection info) + regions
BEGIN, GO, END = "begin", "go", "end"


@dataclass(frozen=True)
class NixlRequest:
    """What a reader asks for (step 1)."""

    tenant: str
    model: str
    version: int
    layout_digest: int
    token: bytes


@dataclass(frozen=True)
class NixlOffer:
    """What a holder answers a reader whose token it accepted (step 2): its agent's
    metadata (opaque bytes for `nixl_agent.add_remote_agent`) and, per layout tensor in
    layout order, the address and length of its registered host memory."""

    agent: str
    metadata: bytes
    regions: tuple[tuple[int, int], ...]


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps({"format": FORMAT, **doc}, separators=(",", ":")).encode()


def _malformed(what: str, why: object) -> TransportError:
    return TransportError(f"NIXL control {what} is malformed: {why}")


def encode_request(req: NixlRequest) -> bytes:
    return _dumps(
        {
            "tenant": req.tenant,
            "model": req.model,
            "version": req.version,
            "layout": req.layout_digest,
            "token": req.token.hex(),
        }
    )


def decode_request(data: bytes) -> NixlRequest:
    """Parse and validate a request; `TransportError` on anything else."""
    doc = decode_json(data, MAX_REQUEST_BYTES, "NIXL control request", FORMAT)
    try:
        tenant, model, version, digest = doc["tenant"], doc["model"], doc["version"], doc["layout"]
        token = bytes.fromhex(doc["token"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _malformed("request", repr(exc)) from exc
    if not (isinstance(tenant, str) and isinstance(model, str)):
        raise _malformed("request", "tenant and model must be strings")
    if type(version) is not int or type(digest) is not int or version < 0 or digest < 0:
        raise _malformed("request", "version and layout must be integers >= 0")
    return NixlRequest(tenant, model, version, digest, token)


def encode_offer(offer: NixlOffer) -> bytes:
    return _dumps(
        {
            "agent": offer.agent,
            "metadata": base64.b64encode(offer.metadata).decode("ascii"),
            "regions": [list(r) for r in offer.regions],
        }
    )


def encode_refusal(code: ErrorCode, message: str) -> bytes:
    return _dumps({"error": {"code": int(code), "message": message[:1024]}})


class Op(NamedTuple):
    """A control op (step 3). `begin` carries the reader's read token as it is now, so the
    holder checks it again before every READ, as the TCP holder does every GET: a token that
    expired or was revoked mid-channel stops the next batch."""

    name: str
    token: bytes = b""


def encode_op(op: str, token: bytes = b"") -> bytes:
    """`begin` (with `token`), `go` or `end` (step 3)."""
    doc: dict[str, Any] = {"op": op}
    if op == BEGIN:
        doc["token"] = token.hex()
    return _dumps(doc)


def _refusal(doc: dict[str, Any]) -> Refusal | None:
    error = doc.get("error")
    if error is None:
        return None
    if not isinstance(error, dict) or type(error.get("code")) is not int:
        raise _malformed("refusal", "no integer code")
    raw = int(error["code"])
    code = ErrorCode(raw) if raw in ErrorCode._value2member_map_ else None
    return Refusal(code, raw, str(error.get("message", "")))


def decode_offer(data: bytes) -> NixlOffer | Refusal:
    """The holder's answer to a request: its offer, or a `Refusal` with a typed code."""
    doc = decode_json(data, MAX_OFFER_BYTES, "NIXL control offer", FORMAT)
    refusal = _refusal(doc)
    if refusal is not None:
        return refusal
    try:
        agent, metadata = doc["agent"], base64.b64decode(doc["metadata"], validate=True)
        regions = tuple((int(a), int(n)) for a, n in doc["regions"])
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise _malformed("offer", repr(exc)) from exc
    if not isinstance(agent, str) or not agent:
        raise _malformed("offer", "no agent name")
    if any(n < 0 or (n and a <= 0) for a, n in regions):
        raise _malformed("offer", "a region has a negative length or a null address")
    return NixlOffer(agent, metadata, regions)


def decode_op(data: bytes) -> Op | Refusal:
    """An op message (`begin` with its token, `go`, `end`), or a `Refusal`."""
    doc = decode_json(data, MAX_REQUEST_BYTES, "NIXL control message", FORMAT)
    refusal = _refusal(doc)
    if refusal is not None:
        return refusal
    op = doc.get("op")
    if op not in (BEGIN, GO, END):
        raise _malformed("message", f"unknown op {op!r}")
    if op != BEGIN:
        return Op(str(op))
    try:
        token = bytes.fromhex(doc["token"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _malformed("message", f"begin without a read token: {exc!r}") from exc
    return Op(BEGIN, token)
