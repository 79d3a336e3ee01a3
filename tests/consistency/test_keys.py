"""Key schema and strict name validation."""

from __future__ import annotations

import pytest

from consistency import Keys
from tensorhub.errors import InvalidArgument, InvalidName
from tensorhub.names import validate_name, validate_version

BAD_NAMES = [
    "",
    "../",
    "..",
    "a/b",
    "/",
    "a..b",
    "A",
    "-lead",
    ".hidden",
    "x" * 200,
    "x" * 64,
    "pölicy",
    "模型",
    "policy\n",
    "a b",
    None,
    7,
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_rejected_with_the_rule(name: object) -> None:
    with pytest.raises(InvalidName, match=r"must match"):
        validate_name(name, "model")


@pytest.mark.parametrize("name", ["a", "policy", "team-a", "v1.2_x", "0", "x" * 63])
def test_good_names_pass(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize("version", [0, -1, True, 1.5, "3", 10**20])
def test_bad_versions(version: object) -> None:
    with pytest.raises(InvalidArgument):
        validate_version(version)


def test_layout_matches_the_design() -> None:
    k = Keys("/tensorhub/v1")
    assert k.latest("team-a", "policy") == "/tensorhub/v1/t/team-a/m/policy/latest"
    assert (
        k.manifest("team-a", "policy", 17)
        == "/tensorhub/v1/t/team-a/m/policy/v/00000000000000000017/manifest"
    )
    assert k.holder("t", "m", 3, "h1").endswith("/v/00000000000000000003/h/h1")
    assert k.pin("t", "m", 3, "p1").endswith("/pin/p1")
    assert k.shard("t", "m", 3, 2).endswith("/shard/000002")
    assert k.tenant_record("t") == "/tensorhub/v1/tenants/t"


def test_no_key_can_escape_its_tenant() -> None:
    k = Keys()
    for bad in ("../other", "t/../../x", "t/m"):
        with pytest.raises(InvalidName):
            k.model(bad, "m")
        with pytest.raises(InvalidName):
            k.model("t", bad)


def test_version_keys_sort_in_version_order() -> None:
    k = Keys()
    assert sorted([k.manifest("t", "m", v) for v in (10, 9, 100)]) == [
        k.manifest("t", "m", v) for v in (9, 10, 100)
    ]


def test_parse_round_trip() -> None:
    k = Keys()
    assert k.parse_version_key("t", "m", k.holder("t", "m", 5, "h")) == (5, "h", "h")
    assert k.parse_version_key("t", "m", k.manifest("t", "m", 5)) == (5, "manifest", "")
    legacy = f"{k.version('t', 'm', 5)}seed/dc1"  # left by a hub from before ElectSeed went
    assert k.parse_version_key("t", "m", legacy) == (5, "seed", "dc1")
    with pytest.raises(InvalidArgument):
        k.parse_version_key("t", "m", k.latest("t", "m"))


@pytest.mark.parametrize("prefix", ["", "noslash", "/trailing/", "/a//b"])
def test_bad_prefix(prefix: str) -> None:
    with pytest.raises(InvalidArgument):
        Keys(prefix)


def test_parse_version_keys_is_parse_version_key_of_each() -> None:
    """The scan's parse (the model's prefix made once) answers as one parse a key, and
    refuses a key outside the shape as it does."""
    k = Keys()
    keys = [
        k.manifest("t", "m", 5),
        k.shard("t", "m", 5, 3),
        k.holder("t", "m", 5, "h"),
        k.pin("t", "m", 7, "p"),
        f"{k.version('t', 'm', 5)}seed/dc1",
    ]
    assert list(k.parse_version_keys("t", "m", keys)) == [
        k.parse_version_key("t", "m", key) for key in keys
    ]
    for bad in (k.latest("t", "m"), f"{k.versions('t', 'm')}x/manifest", k.manifest("t", "n", 5)):
        with pytest.raises(InvalidArgument):
            list(k.parse_version_keys("t", "m", [k.manifest("t", "m", 1), bad]))
