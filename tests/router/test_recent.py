"""`RecentBlocks`: the blocks of the prompts sent to each worker lately that
its pool still holds, against a plain model of it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from allocator_service.core.hashing import prompt_chain
from router.recent import RecentBlocks

BLOCK = 4
FP = "m"


def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return prompt_chain(FP, tokens, BLOCK, salt)


def test_a_block_sent_twice_counts_once_and_is_the_newest():
    recent = RecentBlocks()
    # three whole blocks before the last token
    recent.record("w", 1, FP, BLOCK, 64, [*range(12), 99], None)
    recent.record("w", 2, FP, BLOCK, 64, [*range(8), 7, 7, 7, 7, 99], None)  # shares the first two
    assert recent.blocks("w") == 4
    assert recent.blocks("other") == 0
    # the oldest is the third block of the first prompt: the second refreshed the first two
    assert recent.blocks("w", held=lambda h: h != chain([*range(12), 99])[2]) == 3


def test_salts_and_pool_size_bound_what_is_counted():
    recent = RecentBlocks()
    prompt = [*range(40), 99]  # ten whole blocks
    recent.record("w", 1, FP, BLOCK, 6, prompt, None)
    assert recent.blocks("w") == 6  # at most the pool's blocks: its last six
    recent.record("w", 2, FP, BLOCK, 64, prompt, "tenant-b")
    assert recent.blocks("w") == 16  # another salt's blocks are other blocks
    recent.record("w", 3, FP, BLOCK, 64, prompt, "\ud800")  # a salt the allocator refuses: nothing
    recent.record("w", 4, FP, 0, 64, prompt, None)  # no block size known: nothing
    assert recent.blocks("w") == 16


def test_trimming_stops_at_a_request_still_computing():
    recent = RecentBlocks()
    recent.record("w", 1, FP, BLOCK, 64, [*range(8), 99], None)
    recent.record("w", 2, FP, BLOCK, 64, [*range(100, 108), 99], None)
    nothing_held = lambda h: False  # noqa: E731 - the view has heard of no block yet
    # request 1's blocks may not be computed yet
    assert recent.blocks("w", nothing_held, pending={1}) == 4
    # request 1's went; 2's stop the trimming
    assert recent.blocks("w", nothing_held, pending={2}) == 2
    assert recent.blocks("w", nothing_held, pending=()) == 0


events = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=12),
        st.integers(1, 8),
    ),
    max_size=30,
)


@given(events, st.sets(st.integers(0, 40)))
def test_counts_match_a_plain_model(placements, evicted):
    """Per worker: the distinct blocks of its placements, newest last, at most the pool's
    size; trimmed from the oldest while the pool no longer holds them."""
    recent = RecentBlocks()
    model: dict[str, list[bytes]] = {}
    for rid, (url, ids, num_blocks) in enumerate(placements):
        tokens = [*ids, 9]
        recent.record(url, rid, FP, BLOCK, num_blocks, tokens, None)
        sent = model.setdefault(url, [])
        for h in chain(tokens):
            if h in sent:
                sent.remove(h)
            sent.append(h)
        del sent[: max(len(sent) - num_blocks, 0)]
    for url in ("a", "b"):
        assert recent.blocks(url) == len(model.get(url, []))
    # the pools have evicted some of the blocks (small ids: prompts share blocks)
    seen = sorted({h for sent in model.values() for h in sent})
    gone = {seen[k] for k in evicted if k < len(seen)}
    held = lambda h: h not in gone  # noqa: E731
    for url in ("a", "b"):
        sent = list(model.get(url, []))
        while sent and sent[0] in gone:
            sent.pop(0)
        assert recent.blocks(url, held) == len(sent)
