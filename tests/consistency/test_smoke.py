from consistency import HolderRecord, Session, VersionRegistry, HolderRegistry, Etcd


def test_publish_and_latest(etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry) -> None:
    with Session(etcd, ttl=2) as s:
        rec = HolderRecord("trainer-0", {"tcp": "127.0.0.1:1"}, session=s.id)
        p = versions.publish("team-a", "policy", 1, b"m1", rec)
        assert p.visible
        assert versions.latest("team-a", "policy")[0] == 1
        info = versions.describe("team-a", "policy", 1)
        assert info.manifest == b"m1"
        assert [h.holder for h in info.holders] == ["trainer-0"]
