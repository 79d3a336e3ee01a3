"""The names of the publisher's chunk checksum algorithms a manifest may carry (its
`checksum` field; "" is `xxh3-64`). A leaf of its own, so the hub validates manifests without
importing torch; the algorithms are `transport.checksums`."""

XXH3 = "xxh3-64"
WSUM64 = "wsum64"
KINDS = (XXH3, WSUM64)
# Kinds that are linear in the chunk's words: two chunks with the same value are easy to
# make on purpose. A delta of a version checksummed with one also records the xxh3-64 of
# each of its chunks (`Delta.result_xxh3`), which every reader checks (docs/security.md).
LINEAR = (WSUM64,)
