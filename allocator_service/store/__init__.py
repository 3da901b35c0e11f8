"""The durable store: the registry of pools as a deterministic state machine
(`registry.py`), where its records go (`journal.py`) and how they are framed
(`framing.py`), the verified replay and `--check` (`replay.py`), the journal
write before each change, snapshots and the store's health (`durable.py`), a
snapshot's cut and its size bound (`cut.py`), and the KV event log
numbered in record order (`events.py`). Imports no grpc: the service above
calls in here with its locks held.
"""
