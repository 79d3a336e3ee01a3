"""The NIXL control channel's messages (transport/nixl/protocol.py): what each side accepts.
Plain Python, no NIXL needed: these run in every environment."""

from __future__ import annotations

import json

import pytest

from tensorhub.errors import TransportError
from transport.nixl.protocol import (
    BEGIN,
    END,
    FORMAT,
    GO,
    NixlOffer,
    NixlRequest,
    Op,
    decode_offer,
    decode_op,
    decode_request,
    encode_offer,
    encode_op,
    encode_refusal,
    encode_request,
)
from transport.wire import ErrorCode, Refusal


def _doc(**fields: object) -> bytes:
    return json.dumps({"format": FORMAT, **fields}).encode()


def test_request_round_trip() -> None:
    req = NixlRequest("team-a", "policy", 7, 12345, b"\x00token\xff")
    assert decode_request(encode_request(req)) == req


@pytest.mark.parametrize(
    "doc",
    [
        {"tenant": "t", "model": "m", "version": -1, "layout": 1, "token": ""},
        {"tenant": "t", "model": "m", "version": 1, "layout": "1", "token": ""},
        {"tenant": 1, "model": "m", "version": 1, "layout": 1, "token": ""},
        {"tenant": "t", "model": "m", "version": 1, "layout": 1, "token": "zz"},
        {"tenant": "t", "model": "m", "version": 1, "layout": 1},
    ],
)
def test_malformed_request_refused(doc: dict[str, object]) -> None:
    with pytest.raises(TransportError, match="malformed"):
        decode_request(_doc(**doc))


def test_request_of_another_format_refused() -> None:
    data = json.dumps({"format": "tensorhub-rdma/1", "tenant": "t"}).encode()
    with pytest.raises(TransportError, match="format"):
        decode_request(data)


def test_offer_round_trip() -> None:
    offer = NixlOffer("tensorhub-holder-1-abc", b"\x01\x02metadata", ((4096, 100), (0, 0)))
    assert decode_offer(encode_offer(offer)) == offer


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("regions", [[0, 100]], "null address"),
        ("regions", [[4096, -1]], "negative length"),
        ("regions", [[4096]], "malformed"),
        ("metadata", "not base64!", "malformed"),
        ("agent", "", "no agent name"),
    ],
)
def test_malformed_offer_refused(field: str, value: object, why: str) -> None:
    doc: dict[str, object] = {"agent": "a", "metadata": "AA==", "regions": [[4096, 1]]}
    doc[field] = value
    with pytest.raises(TransportError, match=why):
        decode_offer(_doc(**doc))


def test_refusal_keeps_its_code() -> None:
    answer = decode_offer(encode_refusal(ErrorCode.DENIED, "read token refused"))
    assert isinstance(answer, Refusal)
    assert answer.code is ErrorCode.DENIED
    assert decode_op(encode_refusal(ErrorCode.RELEASED, "gone")) == Refusal(
        ErrorCode.RELEASED, int(ErrorCode.RELEASED), "gone"
    )


def test_unknown_refusal_code_is_kept_raw() -> None:
    answer = decode_offer(_doc(error={"code": 99, "message": "newer holder"}))
    assert isinstance(answer, Refusal)
    assert answer.code is None
    assert answer.raw == 99


def test_ops() -> None:
    assert [decode_op(encode_op(op)) for op in (GO, END)] == [Op(GO), Op(END)]
    assert decode_op(encode_op(BEGIN, b"tok")) == Op(BEGIN, b"tok")
    with pytest.raises(TransportError, match="unknown op"):
        decode_op(_doc(op="read-everything"))
    with pytest.raises(TransportError, match="begin without a read token"):
        decode_op(_doc(op=BEGIN))  # every READ is asked for with the token as it is now
