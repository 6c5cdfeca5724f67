"""A decoder layer (`layers.py`), a decode step's whole stack (`stack.py`) and an engine
decode step's forward (`decode_forward.py`) as single calls of the CPU library, with the
`Snapshot` that tells when a description went stale (`snapshot.py`)."""
