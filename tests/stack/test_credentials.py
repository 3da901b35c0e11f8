"""`pagedkv credentials` (compose's credentials service) and what `pagedkv up`
generates: a token per worker bound to its id and address, the router's and
an admin's, readable by their owner only, kept across restarts."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from allocator_service.roles import WorkerGrant, parse_worker_tokens
from pagedkv.stack.credentials import write_credentials

WORKERS = [("worker-1", "http://worker-1:8000"), ("worker-2", "http://worker-2:8000/")]


def _files(d) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(d.iterdir()) if p.is_file()}


def test_each_worker_gets_a_token_bound_to_its_id_and_address(tmp_path):
    assert write_credentials(tmp_path, WORKERS)
    files = _files(tmp_path)
    assert set(files) == {
        "worker-tokens",
        "worker-1.token",
        "worker-2.token",
        "router-token",
        "admin-token",
        "journal-key",
        "worker-1.store-key",
        "worker-2.store-key",
        "api-keys",
    }
    for p in tmp_path.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    grants = parse_worker_tokens(files["worker-tokens"])
    assert grants == {
        files["worker-1.token"].strip(): WorkerGrant("worker-1", "http://worker-1:8000"),
        files["worker-2.token"].strip(): WorkerGrant("worker-2", "http://worker-2:8000"),
    }
    tokens = [v.strip() for v in files.values() if "\n" == v[-1] and " " not in v.strip()]
    assert len(set(tokens)) == len(tokens) == 8 and all(len(t) >= 40 for t in tokens)


def test_a_restart_keeps_them_and_other_workers_renew_them(tmp_path):
    write_credentials(tmp_path, WORKERS)
    first = _files(tmp_path)
    assert not write_credentials(tmp_path, WORKERS)  # a container restarted: the same tokens
    assert _files(tmp_path) == first
    assert write_credentials(tmp_path, [*WORKERS, ("worker-3", "http://worker-3:8000")])
    assert set(parse_worker_tokens(_files(tmp_path)["worker-tokens"]).values()) >= {
        WorkerGrant("worker-3", "http://worker-3:8000")
    }
    assert _files(tmp_path)["router-token"] != first["router-token"]
    # the journal key is never written again: the journal keyed with it stays readable;
    # nor the API key: the clients keep theirs
    assert _files(tmp_path)["journal-key"] == first["journal-key"]
    assert _files(tmp_path)["api-keys"] == first["api-keys"]


def test_the_command_says_what_it_did_and_refuses_a_bad_worker(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "pagedkv",
        "credentials",
        str(tmp_path / "c"),
        "worker-1=http://worker-1:8000",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "credentials for 1 workers" in r.stdout and "(written)" in r.stdout
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "(kept)" in r.stdout
    r = subprocess.run([*cmd[:-1], "worker-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "want WORKER_ID=URL" in r.stderr and "Traceback" not in r.stderr


def test_each_worker_gets_its_store_groups_key(tmp_path):
    """Without a group each worker is its own (its own key); with one, the workers
    share one key and their tokens file lines name the group. Keys are kept."""
    write_credentials(tmp_path / "own", WORKERS)
    own = _files(tmp_path / "own")
    assert (
        own["worker-1.store-key"] != own["worker-2.store-key"]
        and len(own["worker-1.store-key"].strip()) >= 32
    )
    assert {g.store_group for g in parse_worker_tokens(own["worker-tokens"]).values()} == {
        "worker-1",
        "worker-2",
    }
    # the group changed: the tokens file too
    assert write_credentials(tmp_path / "own", WORKERS, "team")
    grouped = _files(tmp_path / "own")
    assert {g.store_group for g in parse_worker_tokens(grouped["worker-tokens"]).values()} == {
        "team"
    }
    assert (
        grouped["worker-1.store-key"] == grouped["worker-2.store-key"] == own["worker-1.store-key"]
    )
    assert not write_credentials(tmp_path / "own", WORKERS, "team")
    with pytest.raises(
        ValueError, match=r"the store group 'a.b' must be 1 to 64 characters of \[A-Za-z0-9_-\]"
    ):
        write_credentials(tmp_path / "bad", WORKERS, "a.b")


def test_a_guest_worker_is_a_store_group_of_its_own(tmp_path):
    """A guest (a worker the stack does not run: `LocalStack(guest_workers=...)`) gets
    a token bound to its id and address, outside the workers' group, with a key of its own."""
    guest = ("guest", "http://guest:8000")
    assert write_credentials(tmp_path, WORKERS, "team", [guest])
    files = _files(tmp_path)
    grants = {g.worker_id: g for g in parse_worker_tokens(files["worker-tokens"]).values()}
    assert (
        grants["guest"] == WorkerGrant("guest", "http://guest:8000")
        and grants["guest"].store_group == "guest"
    )
    assert {grants[w].store_group for w, _ in WORKERS} == {"team"}
    assert files["guest.token"].strip() != files["worker-1.token"].strip()
    assert files["guest.store-key"] != files["worker-1.store-key"] == files["worker-2.store-key"]
    assert not write_credentials(tmp_path, WORKERS, "team", [guest])  # kept
    with pytest.raises(ValueError, match="an id and an address of its own"):
        write_credentials(tmp_path, WORKERS, "team", [("worker-1", "http://elsewhere:8000")])


def test_split_gives_each_process_only_its_own_files(tmp_path):
    """`--split`: a folder per process; no worker's or the router's holds the admin token
    or another worker's token."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "credentials",
            str(tmp_path),
            *(f"{w}={u}" for w, u in WORKERS),
            "--store-group",
            "stack",
            "--split",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    files = _files(tmp_path)
    held = {
        d.name: {p.name: p.read_text() for p in d.iterdir()}
        for d in tmp_path.iterdir()
        if d.is_dir()
    }
    assert held == {
        "allocator": {
            n: files[n] for n in ("worker-tokens", "router-token", "admin-token", "journal-key")
        },
        "router": {n: files[n] for n in ("router-token", "api-keys")},
        "worker-1": {n: files[n] for n in ("worker-1.token", "worker-1.store-key", "api-keys")},
        "worker-2": {n: files[n] for n in ("worker-2.token", "worker-2.store-key", "api-keys")},
    }
    assert all(
        stat.S_IMODE(p.stat().st_mode) == 0o600
        for d in tmp_path.iterdir()
        if d.is_dir()
        for p in d.iterdir()
    )
