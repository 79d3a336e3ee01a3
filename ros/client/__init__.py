"""The client SDK: `ros.connect(...)` returns a `Hub` (see docs/sdk.md)."""
