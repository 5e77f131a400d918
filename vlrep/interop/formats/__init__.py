"""One module per foreign format, each with both directions it supports (import: `score`, `read`; export:
`export`); the machinery they share is vlrep/interop/keymaps.py, which states the contract. Found by name with
`vlrep.modules.get("interop.formats", name, "format")`."""
