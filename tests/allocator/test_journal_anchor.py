"""The journal anchor, on real processes (a real redis-server on its own
port): whoever can write to Redis but has not the journal key cannot forge
a record, but could put back an older valid state (a rollback) or another
valid history written under the same key. An allocator with a journal
anchor file refuses both at start and in `--check`, with one line; without
the file the older state is accepted as sound, which is what the anchor is
for. Deleting the file is the way to start on a backup restored on
purpose."""

from __future__ import annotations

import time

from allocator_service.store.anchor import read_anchor
from allocator_service.wire.codec import encode_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import register, stub
from tests.support.state_store import keys, run_check, start_fails

STATE_KEYS = ("journal", "head", "snapshot")


def steps(s, md, ref, first: int, n: int) -> None:
    for step_id in range(first, first + n):
        s.Step(
            pb.StepRequest(pool=ref, step_id=step_id, ops=encode_ops([]), prev_step_id=step_id - 1),
            metadata=md,
        )


def saved(client, prefix: str) -> dict:
    return {
        "journal": client.lrange(prefix + "journal", 0, -1),
        "head": client.get(prefix + "head"),
        "snapshot": client.get(prefix + "snapshot"),
    }


def put_back(client, prefix: str, state: dict) -> None:
    client.delete(*(prefix + k for k in STATE_KEYS))
    if state["journal"]:
        client.rpush(prefix + "journal", *state["journal"])
    for k in ("head", "snapshot"):
        if state[k] is not None:
            client.set(prefix + k, state[k])


def test_a_rolled_back_or_replaced_store_is_refused(store, allocator_server, tmp_path):
    url, _ = store
    key_file = tmp_path / "journal-key"
    key_file.write_text("k" * 43 + "\n")
    anchor_file = tmp_path / "anchor"
    keyed = {"PAGEDKV_ALLOCATOR_JOURNAL_KEY_FILE": str(key_file)}
    anchored = {**keyed, "PAGEDKV_ALLOCATOR_JOURNAL_ANCHOR_FILE": str(anchor_file)}
    client, prefix = keys(url)

    with allocator_server("--state", url, env=anchored) as server:
        s, md, channel = stub(server.address)
        ref = register(s, md, "w", num_blocks=24)
        steps(s, md, ref, 1, 4)
        older = saved(client, prefix)
        time.sleep(1.1)  # the anchor is noted about once a second
        steps(s, md, ref, 5, 4)
        channel.close()
        server.kill()
    anchor = read_anchor(anchor_file)
    old_head = int(older["head"].split(b":")[0])
    assert anchor is not None and anchor.index > old_head, (anchor, old_head)

    # the store as this allocator left it: sound, and it starts on it, noting the last record
    assert run_check(url, anchored)[0] == 0
    with allocator_server("--state", url, env=anchored) as server:
        server.kill()
    anchor = read_anchor(anchor_file)
    assert anchor.index == int(client.get(prefix + "head").split(b":")[0]) > old_head

    # a rollback to the older (valid, keyed) state: refused with the anchor...
    newer = saved(client, prefix)
    put_back(client, prefix, older)
    code, out = run_check(url, anchored)
    assert code == 1 and "rolled back" in out and f"record {anchor.index}" in out, out
    code, out = start_fails(url, anchored)
    assert code == 1 and "cannot start" in out and "rolled back" in out, out
    # ... and sound without it: nothing in Redis alone tells it from the real state
    code, out = run_check(url, keyed)
    assert code == 0 and "verdict: sound" in out, out

    # another history under the same key, as long as this one: refused at the anchored record
    client.delete(*(prefix + k for k in STATE_KEYS))
    with allocator_server("--state", url, env=keyed) as server:
        s, md, channel = stub(server.address)
        other = register(s, md, "other", num_blocks=24)
        steps(s, md, other, 1, 12)
        channel.close()
        server.kill()
    code, out = run_check(url, anchored)
    assert code == 1 and "another history" in out, out
    assert start_fails(url, anchored)[0] == 1

    # the real state back: it starts; a restore on purpose starts once the file is deleted
    put_back(client, prefix, newer)
    assert run_check(url, anchored)[0] == 0
    put_back(client, prefix, older)
    anchor_file.unlink()
    with allocator_server("--state", url, env=anchored) as server:
        server.kill()
    assert read_anchor(anchor_file).index == old_head
    client.close()


def test_an_unreadable_anchor_file_is_one_line(store, tmp_path):
    url, _ = store
    anchor_file = tmp_path / "anchor"
    anchor_file.write_text("not a head marker\n")
    env = {"PAGEDKV_ALLOCATOR_JOURNAL_ANCHOR_FILE": str(anchor_file)}
    code, out = start_fails(url, env)
    assert code == 1 and "cannot start" in out and "not `<index>:<64 hex digits>`" in out, out
    code, out = start_fails("memory", env)
    assert code == 2 and "needs --state redis" in out, out
