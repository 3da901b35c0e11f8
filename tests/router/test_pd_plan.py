"""Which workers take a request, or its prefill and decode legs (`router.pd.plan`),
for every mix of roles and store namespaces; and the prefill leg's body."""

from __future__ import annotations

import json

import pytest

from pagedkv_base.api.errors import ApiError
from router.discovery import Worker
from router.pd import Split, plan, prefill_body, wanted_tokens


def _w(name: str, role: str, namespace: str = "g.layout") -> Worker:
    return Worker(f"http://{name}", name, kv_role=role, store_namespace=namespace)


def _names(workers) -> list[str]:
    return [w.name for w in workers]


def test_both_workers_only_take_whole_requests():
    workers = [_w("a", "both"), _w("b", "both", "")]
    assert plan(workers) == workers


def test_prefill_and_decode_split_and_both_workers_join_the_decode_side():
    split = plan([_w("p", "prefill"), _w("d", "decode"), _w("b", "both")])
    assert isinstance(split, Split)
    assert _names(split.prefill) == ["p"]
    assert {ns: _names(ws) for ns, ws in split.decode.items()} == {"g.layout": ["d", "b"]}


def test_only_workers_of_one_namespace_pair_up():
    split = plan([_w("p1", "prefill", "g.x"), _w("p2", "prefill", "h.x"), _w("d", "decode", "g.x")])
    assert _names(split.prefill) == ["p1"]
    assert list(split.decode) == ["g.x"]


def test_no_pair_sends_whole_requests_to_both_workers():
    both = _w("b", "both", "")  # no store: it cannot take a decode leg
    assert plan([_w("p", "prefill", "g.x"), _w("d", "decode", "h.x"), both]) == [both]
    assert plan([_w("d", "decode"), both]) == [both]


@pytest.mark.parametrize(
    "workers, says",
    [
        ([_w("d", "decode")], "only decode workers; a decode worker answers only what"),
        ([_w("p", "prefill")], "only prefill workers; a prefill worker's blocks need"),
        (
            [_w("p", "prefill", "g.x"), _w("d", "decode", "h.x")],
            "only decode and prefill workers; the prefill and decode workers share no",
        ),
    ],
)
def test_a_fleet_the_router_cannot_serve_is_a_503_with_its_reason(workers, says):
    with pytest.raises(ApiError) as err:
        plan(workers)
    assert err.value.status == 503
    assert err.value.code == "no_worker_for_role"
    assert says in err.value.message


def test_the_prefill_leg_computes_the_prompt_and_one_token():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "cache_salt": "s",
        "max_completion_tokens": 50,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
    }
    assert json.loads(prefill_body(json.dumps(body).encode())) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "cache_salt": "s",
        "temperature": 0.7,
        "max_tokens": 1,
    }


def test_a_decode_admission_finds_the_whole_blocks_before_the_last_token():
    assert [wanted_tokens(range(n), 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 4, 4, 8]
