"""A stack's credentials, generated once and kept in one folder.

`pagedkv up` (through `LocalStack`) and docker-compose (its `credentials`
service, `pagedkv credentials DIR ID=URL ...`) write the same files, each
readable by its owner only:

- `worker-tokens`: the allocator's `--worker-tokens-file`, one
  `WORKER_ID URL TOKEN` per worker: each token registers its worker only,
  at its address;
- `<WORKER_ID>.token`: that worker's `--allocator-token-file`;
- `router-token`: the router's token (the allocator's and the router's
  `--router-token-file`);
- `admin-token`: the allocator's `--admin-token-file`, for an operator;
- `journal-key`: the allocator's journal key (`PAGEDKV_ALLOCATOR_JOURNAL_KEY_FILE`),
  which keys the chain of its Redis journal.

Written again only when the workers (ids or addresses) differ from the
folder's: a restarted container keeps its token. The journal key is written
once and never again (the journal written under it must stay readable).
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

WORKER_TOKENS, ROUTER_TOKEN, ADMIN_TOKEN = "worker-tokens", "router-token", "admin-token"
JOURNAL_KEY = "journal-key"


def worker_token_file(directory: Path, worker_id: str) -> Path:
    return Path(directory) / f"{worker_id}.token"


def write_secret(path: Path, text: str) -> None:
    """`text` in file `path`, readable by its owner only (written whole, then renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _current(directory: Path) -> list[tuple[str, str]] | None:
    """The (worker id, address) pairs the folder holds tokens for, or None."""
    try:
        lines = (directory / WORKER_TOKENS).read_text().splitlines()
    except OSError:
        return None
    pairs = [tuple(line.split()[:2]) for line in lines if line.strip() and not line.startswith("#")]
    complete = all((directory / n).exists() for n in (ROUTER_TOKEN, ADMIN_TOKEN)) and all(
        worker_token_file(directory, w).exists() for w, _ in pairs)
    return pairs if complete else None  # type: ignore[return-value]


def write_credentials(directory: str | os.PathLike, workers: Sequence[tuple[str, str]]) -> bool:
    """Make the folder's credentials for `workers` ((id, address) pairs);
    True when they were written, False when the folder already held them."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    want = [(w, u.rstrip("/")) for w, u in workers]
    if len({w for w, _ in want}) != len(want) or len({u for _, u in want}) != len(want):
        raise ValueError("each worker needs an id and an address of its own")
    if not (d / JOURNAL_KEY).exists():
        write_secret(d / JOURNAL_KEY, secrets.token_urlsafe(32) + "\n")
    if _current(d) == want:
        return False
    table = []
    for worker_id, url in want:
        token = secrets.token_urlsafe(32)
        table.append(f"{worker_id} {url} {token}\n")
        write_secret(worker_token_file(d, worker_id), token + "\n")
    write_secret(d / ROUTER_TOKEN, secrets.token_urlsafe(32) + "\n")
    write_secret(d / ADMIN_TOKEN, secrets.token_urlsafe(32) + "\n")
    write_secret(d / WORKER_TOKENS, "".join(table))  # last: it says the folder is complete
    return True


# ------------------------------------------------------------ the command

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "credentials", help="generate a stack's credentials (what docker-compose's credentials service runs)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="the folder to write them to (kept when it already holds them)")
    p.add_argument("workers", nargs="+", metavar="WORKER_ID=URL", help="each worker and the address it advertises")
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
        written = write_credentials(args.directory, pairs)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    print(f"credentials for {len(pairs)} workers in {args.directory} ({'written' if written else 'kept'})")
    return 0
