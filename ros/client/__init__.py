"""The client SDK: `ros.connect(...)` returns a `Hub` (see DESIGN.md §6)."""
