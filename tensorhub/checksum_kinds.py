"""The names of the publisher's chunk checksum algorithms a manifest may carry (its
`checksum` field; "" is `xxh3-64`). A leaf of its own, so the hub validates manifests without
importing torch; the algorithms are `transport.checksums`."""

XXH3 = "xxh3-64"
WSUM64 = "wsum64"
KINDS = (XXH3, WSUM64)
