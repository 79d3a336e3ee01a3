"""The intruder: a second tenant that keeps trying to reach the first tenant's data.

Invariant 6 (isolation) is checked from what it records: every probe ends `refused`
(the system said no, or showed only the intruder's own empty namespace), `allowed` (it got
at the victim's data: a violation), or `unknown` (the target was unreachable, e.g. a killed
holder; proves nothing either way). Probes, in turn:

- hub: `latest`, `fetch` and `inspect` of the victim's model name with the intruder's own
  token — confined to its own prefix, they must see nothing;
- each round of probes aims at the victim's model, then at its delta companion
  (`{model}.delta`), in turn;
- hub: a call with a forged token that claims the victim tenant;
- holder ports (the victim's holders, whose addresses the run hands over as an attacker
  would scan for them): a GET for the victim's model with a read token the intruder minted
  with its own tenant key but naming the victim tenant, one naming its own tenant, and one
  with random bytes. Each must be answered DENIED; any CHUNK or any later-stage refusal
  (which means the token check passed) counts as access.
"""

from __future__ import annotations

import secrets
import socket
from typing import TYPE_CHECKING, Any

from chaos.history import OK, error_name
from ros.tokens import issue_read_token
from tensorhub.delta_rules import companion_of
from tensorhub.errors import InvalidArgument, PermissionDenied, TensorHubError, VersionNotFound
from transport.wire import ErrorCode, FrameType, GetRequest, decode_error, encode_get, read_frame

if TYPE_CHECKING:
    from chaos.worker import Worker

PROBE_TIMEOUT = 5.0


def _hub_probe(w: Worker, kind: str, victim: str) -> dict[str, Any]:
    hub = w.client
    try:
        if kind == "hub-latest":
            version = hub.latest(victim, timeout=PROBE_TIMEOUT)
            return {"result": "allowed" if version else "refused", "detail": f"latest={version}"}
        if kind == "hub-fetch":
            held = hub.fetch(victim, "latest", timeout=PROBE_TIMEOUT)
            held.release(force=True)
            return {"result": "allowed", "detail": f"fetched {victim}@{held.version}"}
        info = hub.inspect(victim, timeout=PROBE_TIMEOUT)
        return {"result": "allowed", "detail": f"inspect saw {victim}@{info.version}"}
    except (VersionNotFound, PermissionDenied, InvalidArgument) as exc:
        return {"result": "refused", "detail": error_name(exc)}
    except TensorHubError as exc:
        return {"result": "unknown", "detail": error_name(exc)}


def _forged_token_probe(w: Worker) -> dict[str, Any]:
    import ros

    forged = f"{w.spec['victim_tenant']}.{secrets.token_urlsafe(24)}"
    try:
        with ros.connect(
            w.spec["hubs"], tenant=w.spec["victim_tenant"], token=forged, timeout=PROBE_TIMEOUT
        ) as hub:
            version = hub.latest(w.spec["model"], timeout=PROBE_TIMEOUT)
        return {"result": "allowed", "detail": f"forged token read latest={version}"}
    except PermissionDenied as exc:
        return {"result": "refused", "detail": error_name(exc)}
    except TensorHubError as exc:
        return {"result": "unknown", "detail": error_name(exc)}


def _holder_probe(w: Worker, kind: str, target: str, model: str) -> dict[str, Any]:
    key = w.client.session.read_key  # the intruder's own tenant key
    victim = w.spec["victim_tenant"]
    version = w.rng.randrange(1, 64)
    tenant = victim if kind != "holder-own-tenant" else w.spec["tenant"]
    if kind == "holder-random-token":
        token = secrets.token_bytes(40)
    else:
        token, _ = issue_read_token(key, tenant, model, version)
    request = GetRequest(victim if kind != "holder-own-tenant" else tenant, model, version,
                         w.rng.randrange(2**63), token, (0,), 0)  # fmt: skip
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT) as sock:
            sock.settimeout(PROBE_TIMEOUT)
            sock.sendall(encode_get(request))
            ftype, body = read_frame(sock)
    except (OSError, TensorHubError) as exc:  # no answer at all (holder down or cut off)
        return {"result": "unknown", "detail": f"{target}: {exc}"}
    if ftype is FrameType.CHUNK:
        return {"result": "allowed", "detail": f"{target} sent a CHUNK"}
    if ftype is not FrameType.ERROR:
        return {"result": "unknown", "detail": f"{target} sent a {ftype.name} frame"}
    try:
        refusal = decode_error(body)
    except TensorHubError as exc:  # a malformed ERROR frame: no answer we can read
        return {"result": "unknown", "detail": f"{target}: {exc}"}
    if refusal.code is ErrorCode.DENIED:  # the typed code, never the message's text
        return {"result": "refused", "detail": error_name(refusal.error())}
    if refusal.code is ErrorCode.BUSY:  # refused at accept, before the request was read
        return {"result": "unknown", "detail": f"{target}: {refusal.error()}"}
    # The holder checks the token first: any other refusal means the token passed.
    return {"result": "allowed", "detail": f"{target} passed the token check: {refusal.error()}"}


PROBES = ("hub-latest", "hub-fetch", "hub-inspect", "hub-forged-token",
          "holder-victim-tenant", "holder-own-tenant", "holder-random-token")  # fmt: skip


def intruder(w: Worker) -> None:
    """Probe until the end of the run; one probe at a time, recorded as a `probe` op. Every
    other round of probes aims at the victim model's delta companion (`{model}.delta`, the
    encoded chunks of its delta versions), which its holders serve like any version."""
    w.connect()
    targets: list[str] = list(w.spec.get("targets", []))
    models = (w.spec["model"], companion_of(w.spec["model"]))
    turn = 0
    while w.running():
        kind = PROBES[turn % len(PROBES)]
        model = models[turn // len(PROBES) % len(models)]
        turn += 1
        target = w.rng.choice(targets) if targets else ""
        if kind.startswith("holder") and not target:
            continue
        op = w.rec.invoke("probe", PROBE_TIMEOUT * 2, probe=kind, target=target, model=model)
        if kind == "hub-forged-token":
            value = _forged_token_probe(w)
        elif kind.startswith("hub"):
            value = _hub_probe(w, kind, model)
        else:
            value = _holder_probe(w, kind, target, model)
        w.rec.complete(op, OK, **value)
        w.pause(0.1, 0.3)
