"""The KV event log numbers batches in record order and keeps the last
`retention` events, whatever order the batches finish in and however
large they are (numbering is per batch: a 2,048-event batch costs the
log's lock no more than a one-event batch)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator_service.store.events import EventLog

batches = st.lists(st.integers(0, 7), min_size=1, max_size=30)  # events per record


@settings(max_examples=150, deadline=None)
@given(sizes=batches, retention=st.integers(0, 40), data=st.data())
def test_events_are_numbered_in_record_order_and_the_window_is_the_last_retention(
    sizes, retention, data
):
    log = EventLog(retention)
    begun = [log.begin() for _ in sizes]
    for i, (b, n) in enumerate(zip(begun, sizes, strict=True)):
        for j in range(n):
            b.add("block_stored", f"pool-{i}", block_id=j)
    # Records finish in any order (another pool's long record finishes late).
    order = data.draw(st.permutations(range(len(sizes))))
    for i in order:
        log.finish(begun[i])
    expected = [(f"pool-{i}", j) for i, n in enumerate(sizes) for j in range(n)]
    total = len(expected)
    assert log.published == log.next_sequence == total + 1
    ends = [b.end for b in begun]
    assert ends == [1 + sum(sizes[: i + 1]) for i in range(len(sizes))]
    retained = expected[max(total - retention, 0) :]
    first = total + 1 - len(retained)
    # Read everything from every cursor, in pieces of every size.
    for cursor in range(0, total + 3):
        limit = data.draw(st.integers(1, 9))
        events, after, gap = log.read(cursor, limit, timeout=0)
        assert gap == (cursor < first or cursor > total + 1)
        start = first if gap else cursor
        want = retained[start - first : start - first + limit]
        assert [(e.pool_id, e.block_id) for e in events] == want
        assert [e.sequence for e in events] == list(range(start, start + len(want)))
        assert after == start + len(want)


def test_reset_starts_numbering_again_and_forgets_the_window():
    log = EventLog(10)
    b = log.begin()
    b.add("block_stored", "p", block_id=1)
    log.finish(b)
    log.reset(100)
    events, after, gap = log.read(1, 5, timeout=0)
    assert (events, after, gap) == ([], 100, True)
    b = log.begin()
    b.add("block_removed", "p", block_id=2)
    log.finish(b)
    events, after, gap = log.read(100, 5, timeout=0)
    assert [(e.sequence, e.kind, e.block_id) for e in events] == [(100, "block_removed", 2)]
    assert (after, gap) == (101, False)


core_events = st.one_of(
    st.tuples(
        st.sampled_from(["block_stored", "block_removed"]),
        st.integers(0, 2**20),
        st.binary(min_size=32, max_size=32),
    ),
    st.just(("all_cleared", 0, b"")),
)


@settings(max_examples=100, deadline=None)
@given(runs=st.lists(st.lists(core_events, min_size=1, max_size=5), max_size=6))
def test_a_core_event_reads_back_as_the_same_event_through_either_method(runs):
    """`add_blocks`, the core's short form (a run of one kind), and `add`
    one event at a time give readers equal events, in order."""
    logs = EventLog(100), EventLog(100)
    short, full = logs[0].begin(), logs[1].begin()
    for run in runs:
        kind = run[0][0]
        short.add_blocks(kind, "p", [b for _, b, _ in run], [h for _, _, h in run])
        for _, block, block_hash in run:
            full.add(kind, "p", block, block_hash)
    for log, b in zip(logs, (short, full), strict=True):
        log.finish(b)
    assert logs[0].read(1, 100, timeout=0) == logs[1].read(1, 100, timeout=0)
