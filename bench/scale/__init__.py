"""`tensorhub bench scale`: the scale envelope of docs/design.md, measured on one machine.

Parts (each its own etcd and hub process, all on loopback, every wait bounded):

- `clients` (`sessions`, `load`, `clients`, `ceiling`): N clients per replica, each a session,
  a KeepAlive stream and a versions-only Watch, against the hub and against a minimal
  grpc.aio ceiling server with the same client processes in the same run.
- `holders`: Resolve at 16 and 1,024 holders of one version; one step of 1,024 readers.
- `manifest`: publish and fetch one version of 100,000 tensors in 300,000 chunks.
- `history`: thousands of steps with the hub's compactor; etcd's DB size must stay flat.
- `shards`: one version published by 1,024 ranks at a barrier (a channel and session each)
  and one of 4,096 shards with 256 in flight, on one replica and on two, as ratios to a
  one-shard publish in the same World, with the etcd revisions each took.
- `herd`: 2,000 clients opening at once (session, KeepAlive, versions-only Watch), against
  the ceiling with the same clients, on one replica and on two.
- `reconnect`: SIGKILL of a replica under 2,000 SDK clients; every session must keep its
  lease, its holder record and its renewals.

Every etcd runs with `--max-txn-ops` and `--max-request-bytes` given (etcd's defaults).
"""
