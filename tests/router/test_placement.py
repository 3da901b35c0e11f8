"""Placements that do not depend on the timing of the view: a burst of
requests for a prefix no pool holds yet lands on one worker, while the first
is computed and for a while after its answer has ended (its blocks reach the
router's view by events that may come later); a request that failed leaves
no trace."""

from __future__ import annotations

import asyncio

from router import placement
from router.app import Router
from router.discovery import Discovery, Worker
from router.policy import Balance

WORKERS = [
    Worker(
        f"http://w{i}",
        pool_id=f"p{i}",
        model_fingerprint="m",
        num_blocks=64,
        block_size=4,
        free_blocks=64,
    )
    for i in range(2)
]
BY_URL = {w.url: w for w in WORKERS}
PREFIX = list(range(40))  # ten whole blocks


def _router() -> Router:
    return Router(None, Discovery(None), "kv", balance=Balance(abs_threshold=3, rel_threshold=1.5))


def _send(router: Router, question: int, salt: str | None = None) -> tuple[int, str]:
    """One request placed and counted in flight on its worker,
    as `forward` does; nothing is cached."""
    rid, order = router.placement.place(WORKERS, {}, [*PREFIX, 1000 + question], salt)
    worker = order[0][0]
    router.placement.enter(worker)
    return rid, worker.url


def test_a_burst_for_a_new_prefix_lands_together_until_a_worker_is_overloaded():
    router = _router()
    placed = [_send(router, i)[1] for i in range(4)]
    assert len(set(placed)) == 1  # up to 3 in flight against 0: within the absolute threshold
    rid, fifth = _send(router, 4)
    assert fifth != placed[0]  # 4 - 0 > 3 and 4 > 1.5 * 0: the load decides
    # another salt shares nothing: placed by load alone
    assert _send(router, 5, salt="other")[1] == fifth


def test_a_placement_counts_after_its_answer_until_the_view_can_have_heard(monkeypatch):
    monkeypatch.setattr(placement, "PLACED_LINGER_S", 0.2)
    router = _router()

    async def scenario() -> list[str]:
        rid, first = _send(router, 0)
        router.placement.answered(rid)  # answered; the view has not heard of its blocks
        # and the worker is busier than the other (within the thresholds)
        router.placement.enter(BY_URL[first])
        rid, order = router.placement.place(WORKERS, {}, [*PREFIX, 2000], None)
        router.placement.answered(rid)
        await asyncio.sleep(0.3)
        later = router.placement.place(WORKERS, {}, [*PREFIX, 3000], None)[1][0][0].url
        return [first, order[0][0].url, later, next(w.url for w in WORKERS if w.url != first)]

    first, again, later, other = asyncio.run(scenario())
    assert again == first  # the finished request's placement still attracts its prefix
    # the linger over, nothing is cached anywhere: the worker sent fewer blocks, less loaded
    assert later == other


def test_new_prefixes_spread_evenly_whatever_the_load_in_flight():
    """Each new prefix goes to the worker sent the fewest blocks lately, not to the one
    with fewer requests in flight at that instant: a long request in flight on one
    worker does not draw every new tenant to the other."""
    router = _router()
    rid, order = router.placement.place(WORKERS, {}, [*range(5000, 5040), 1], None)
    busy = order[0][0]
    router.placement.enter(busy)  # in flight until the end: the other always has fewer
    prefixes = {busy.url: 1}
    for tenant in range(8):  # each answered at once (it leaves no request in flight)
        prompt = [*range(100 * (tenant + 1), 100 * (tenant + 1) + 40), 1]
        worker = router.placement.place(WORKERS, {}, prompt, None)[1][0][0]
        prefixes[worker.url] = prefixes.get(worker.url, 0) + 1
    assert sorted(prefixes.values()) == [4, 5]  # 9 prefixes of ten blocks: 4 and 5
