"""The `pagedkv` console command.

Each subcommand lives in its own module and registers itself through
`add_parser(subparsers)`; heavy imports (torch, grpc) happen only inside the
chosen subcommand so `pagedkv --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that provides add_parser(subparsers) and run(args)
SUBCOMMANDS: dict[str, str] = {
    "replay": "pagedkv.tools.replay",
    "kv-size": "pagedkv.tools.kv_size",
    "simulate": "pagedkv.tools.simulate",
    "bench": "pagedkv.bench",
    "allocator": "allocator_service.cli",
    "up": "pagedkv.up",
    "worker": "worker.cli",
    "demo": "pagedkv.demo",
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="PagedKV: a paged KV-cache memory manager for LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMANDS.values():
        module = importlib.import_module(module_name)
        p = module.add_parser(sub)
        p.set_defaults(_module=module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except CliError as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
