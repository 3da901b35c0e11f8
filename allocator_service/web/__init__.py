"""The allocator's web side: `/metrics`, the live `/pools` page and
`/playground` on its HTTP port (`app.py`), the live view's reads and diffs
(`live.py`), the playground's one call on the real core (`playground.py`),
and the static page files (`static/`)."""
