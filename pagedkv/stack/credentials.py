"""A stack's credentials, generated once and kept in one folder.

`pagedkv up` (through `LocalStack`) and docker-compose (its `credentials`
service, `pagedkv credentials DIR ID=URL ...`) write the same files, each
readable by its owner only:

- `worker-tokens`: the allocator's `--worker-tokens-file`, one
  `WORKER_ID URL TOKEN [group=GROUP]` per worker: each token registers its
  worker only, at its address, in its store group (`--store-group`: the
  workers listed trust each other's entries in the shared store; without it
  each worker is a group of its own);
- `<WORKER_ID>.token`: that worker's `--allocator-token-file`;
- `<WORKER_ID>.store-key`: that worker's `--kv-store-key-file`, the secret of
  its store group (one for the workers of a group), which seals its entries;
- `router-token`: the router's token (the allocator's and the router's
  `--router-token-file`);
- `admin-token`: the allocator's `--admin-token-file`, for an operator;
- `journal-key`: the allocator's journal key (`PAGEDKV_ALLOCATOR_JOURNAL_KEY_FILE`),
  which keys the chain of its Redis journal;
- `api-keys`: the stack's API key, the router's and every worker's
  `--api-keys-file`: what a client sends as `Authorization: Bearer KEY`.

With `--split` each process also gets a folder of its own holding only its
files, under the same names, for a deployment that mounts each process its
own folder (compose: a volume each), so a worker never sees the admin
token or another worker's token:

- `allocator/`: `worker-tokens`, `router-token`, `admin-token`, `journal-key`;
- `router/`: `router-token`, `api-keys`;
- `<WORKER_ID>/`: `<WORKER_ID>.token`, `<WORKER_ID>.store-key`, `api-keys`.

Written again only when the workers (ids, addresses or group) differ from
the folder's: a restarted container keeps its token. The journal key, the
store keys and the API key are written once and never again (what was
written under them must stay readable; a client keeps its key).
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

WORKER_TOKENS, ROUTER_TOKEN, ADMIN_TOKEN = "worker-tokens", "router-token", "admin-token"
JOURNAL_KEY = "journal-key"
API_KEYS = "api-keys"
STORE_GROUP = "stack"  # the store group of a stack's own workers (`pagedkv up`, docker-compose)


def worker_token_file(directory: Path, worker_id: str) -> Path:
    return Path(directory) / f"{worker_id}.token"


def store_key_file(directory: Path, worker_id: str) -> Path:
    return Path(directory) / f"{worker_id}.store-key"


def write_secret(path: Path, text: str) -> None:
    """`text` in file `path`, readable by its owner only
    (written whole, then renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_api_keys(directory: str | os.PathLike) -> Path:
    """The folder's API keys file (`API_KEYS`), one key made when it has none; its path."""
    path = Path(directory) / API_KEYS
    if not path.exists():
        write_secret(path, "sk-pagedkv-" + secrets.token_urlsafe(32) + "\n")
    return path


def _current(directory: Path) -> list[tuple[str, ...]] | None:
    """The (worker id, address[, group=GROUP]) of each worker the folder holds
    credentials for, or None."""
    try:
        lines = (directory / WORKER_TOKENS).read_text().splitlines()
    except OSError:
        return None
    rows = [
        (*line.split()[:2], *line.split()[3:])
        for line in lines
        if line.strip() and not line.startswith("#")
    ]
    complete = all((directory / n).exists() for n in (ROUTER_TOKEN, ADMIN_TOKEN)) and all(
        worker_token_file(directory, r[0]).exists() and store_key_file(directory, r[0]).exists()
        for r in rows
    )
    return rows if complete else None


def _store_keys(d: Path, workers: Sequence[str], store_group: str | None) -> None:
    """Each worker's store key, kept when it has one: a shared group's, the same
    for each of its workers (the key of a worker of the group, or a new one)."""
    missing = [w for w in workers if not store_key_file(d, w).exists()]
    if store_group is None:
        for w in missing:
            write_secret(store_key_file(d, w), secrets.token_urlsafe(32) + "\n")
        return
    held = [w for w in workers if w not in missing]
    key = store_key_file(d, held[0]).read_text() if held else secrets.token_urlsafe(32) + "\n"
    for w in workers:
        if w in missing or store_key_file(d, w).read_text() != key:
            write_secret(store_key_file(d, w), key)


def write_credentials(
    directory: str | os.PathLike,
    workers: Sequence[tuple[str, str]],
    store_group: str | None = None,
    guests: Sequence[tuple[str, str]] = (),
) -> bool:
    """Make the folder's credentials for `workers` ((id, address) pairs), all
    in store group `store_group` (None: each its own), and for `guests` (the
    same pairs), each a store group of its own whatever `store_group` is; True
    when they were written, False when the folder already held them."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    members = [(w, u.rstrip("/")) for w, u in workers]
    others = [(w, u.rstrip("/")) for w, u in guests]
    want = members + others
    if len({w for w, _ in want}) != len(want) or len({u for _, u in want}) != len(want):
        raise ValueError("each worker needs an id and an address of its own")
    group = [f"group={store_group}"] if store_group is not None else []
    if store_group is not None:
        from allocator_service.roles import check_store_group

        check_store_group(store_group)
    if not (d / JOURNAL_KEY).exists():
        write_secret(d / JOURNAL_KEY, secrets.token_urlsafe(32) + "\n")
    write_api_keys(d)
    _store_keys(d, [w for w, _ in members], store_group)
    _store_keys(d, [w for w, _ in others], None)
    rows = [(w, u, *group) for w, u in members] + others
    if _current(d) == rows:
        return False
    table = []
    for worker_id, url, *words in rows:
        token = secrets.token_urlsafe(32)
        table.append(" ".join((worker_id, url, token, *words)) + "\n")
        write_secret(worker_token_file(d, worker_id), token + "\n")
    write_secret(d / ROUTER_TOKEN, secrets.token_urlsafe(32) + "\n")
    write_secret(d / ADMIN_TOKEN, secrets.token_urlsafe(32) + "\n")
    write_secret(d / WORKER_TOKENS, "".join(table))  # last: it says the folder is complete
    return True


ALLOCATOR_DIR, ROUTER_DIR = "allocator", "router"


class Wiring(NamedTuple):
    """A local stack's credentials as its processes' command lines (`stack_wiring`)."""

    allocator: list[str]  # the allocator's (and its standby's) flags
    allocator_env: dict[str, str] | None  # the allocator's variables
    to_allocator: list[str]  # what every worker needs to call the allocator
    router_to_allocator: list[str]  # and the router
    per_worker: dict[str, list[str]]  # worker id -> its own files
    api_keys: list[str]  # the router's and every worker's


def stack_wiring(
    directory: Path,
    workers: Sequence[tuple[str, str]],
    *,
    token: str | None,
    credentials: bool,
    guest_workers: Sequence[tuple[str, str]],
    api_key: bool,
    tls: tuple[Path, Path] | None,
) -> Wiring:
    """The credentials of `LocalStack`'s processes, written to `directory`: one
    shared worker `token` (and its router token `TOKEN-router`), else with
    `credentials` a token per worker (`workers`: (id, URL)) and per guest,
    one store group for the stack's workers, the router's and admin tokens and
    the journal key; with `api_key` the clients' key; with `tls` (cert, key)
    what it takes to call the allocator."""
    w = Wiring([], None, [], [], {}, [])
    if token is not None:  # one shared worker token
        token_file, router_file = directory / "allocator-token", directory / ROUTER_TOKEN
        write_secret(token_file, token + "\n")
        write_secret(router_file, token + "-router\n")
        w.allocator.extend(["--auth-token-file", str(token_file)])
        w.to_allocator.extend(["--allocator-token-file", str(token_file)])
        # the router's own credential (the roles table), for this stack's router or another's
        w.allocator.extend(["--router-token-file", str(router_file)])
        w.router_to_allocator.extend(["--router-token-file", str(router_file)])
    elif credentials:
        # a token per worker, bound to its id and address; the stack's workers are one
        # operator's: one store group, whose key seals their store entries
        write_credentials(directory, workers, STORE_GROUP, guest_workers)
        for worker_id, _ in workers:
            w.per_worker[worker_id] = [
                "--allocator-token-file",
                str(worker_token_file(directory, worker_id)),
                "--kv-store-key-file",
                str(store_key_file(directory, worker_id)),
            ]
        w.allocator.extend(
            [
                "--worker-tokens-file",
                str(directory / WORKER_TOKENS),
                "--admin-token-file",
                str(directory / ADMIN_TOKEN),
                "--router-token-file",
                str(directory / ROUTER_TOKEN),
            ]
        )
        w = w._replace(
            allocator_env={"PAGEDKV_ALLOCATOR_JOURNAL_KEY_FILE": str(directory / JOURNAL_KEY)}
        )
        w.router_to_allocator.extend(["--router-token-file", str(directory / ROUTER_TOKEN)])
    if api_key:
        w.api_keys.extend(["--api-keys-file", str(write_api_keys(directory))])
    if tls is not None:
        cert, key = tls
        w.allocator.extend(["--tls-cert", str(cert), "--tls-key", str(key)])
        w.to_allocator.extend(["--allocator-tls-ca", str(cert)])
        w.router_to_allocator.extend(["--allocator-tls-ca", str(cert)])
    return w


def processes_files(workers: Sequence[str]) -> dict[str, list[str]]:
    """Each process's folder (`--split`) and the files it holds."""
    return {
        ALLOCATOR_DIR: [WORKER_TOKENS, ROUTER_TOKEN, ADMIN_TOKEN, JOURNAL_KEY],
        ROUTER_DIR: [ROUTER_TOKEN, API_KEYS],
        **{
            w: [worker_token_file(Path(), w).name, store_key_file(Path(), w).name, API_KEYS]
            for w in workers
        },
    }


def split_credentials(directory: str | os.PathLike, workers: Sequence[str]) -> None:
    """Copy each process's files from the folder into a folder of its own (`processes_files`),
    owned as the folder is (compose runs this as root, to write into volumes of their own, for
    services that run as the folder's owner)."""
    d = Path(directory)
    owner = d.stat()
    for folder, names in processes_files(workers).items():
        (d / folder).mkdir(exist_ok=True)
        paths = [d / folder]
        for name in names:
            write_secret(d / folder / name, (d / name).read_text())
            paths.append(d / folder / name)
        if (owner.st_uid, owner.st_gid) != (os.getuid(), os.getgid()):
            for path in paths:
                os.chown(path, owner.st_uid, owner.st_gid)


# ------------------------------------------------------------ the command


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "credentials",
        help="generate a stack's credentials (what docker-compose's credentials service runs)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "directory", help="the folder to write them to (kept when it already holds them)"
    )
    p.add_argument(
        "workers",
        nargs="+",
        metavar="WORKER_ID=URL",
        help="each worker and the address it advertises",
    )
    p.add_argument(
        "--store-group",
        metavar="NAME",
        help="put these workers in one store group: each loads the shared-store entries the others "
        "write (one trust domain); without it each worker is a group of its own",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="also give each process a folder of its own files (DIR/allocator, DIR/router, "
        "DIR/WORKER_ID), to mount each process only its own",
    )
    return p


def run(args: argparse.Namespace) -> int:
    from pagedkv_base.settings import CliError

    pairs = []
    for spec in args.workers:
        worker_id, sep, url = spec.partition("=")
        if not sep or not worker_id or not url.startswith(("http://", "https://")):
            raise CliError(f"want WORKER_ID=URL (an http:// or https:// URL), not {spec!r}")
        pairs.append((worker_id, url))
    try:
        written = write_credentials(args.directory, pairs, args.store_group)
        if args.split:
            split_credentials(args.directory, [w for w, _ in pairs])
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    print(
        f"credentials for {len(pairs)} workers in {args.directory} "
        f"({'written' if written else 'kept'}); "
        f"the clients' API key: {Path(args.directory) / API_KEYS}"
    )
    return 0
