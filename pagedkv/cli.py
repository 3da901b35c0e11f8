"""The `pagedkv` console command.

Each subcommand lives in its own module and registers itself through
`add_parser(subparsers)`; heavy imports (torch, grpc) happen only inside the
chosen subcommand so `pagedkv --help` stays instant. Errors, Ctrl-C and a
closed stdout are handled the same way for every subcommand
(`pagedkv_base.settings.run_command`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv import __version__
from pagedkv_base.settings import run_command

# subcommand name -> module that provides add_parser(subparsers) and run(args)
SUBCOMMANDS: dict[str, str] = {
    "replay": "pagedkv.tools.replay",
    "kv-size": "pagedkv.tools.kv_size",
    "simulate": "pagedkv.tools.simulate",
    "playground": "pagedkv.tools.playground",
    "bench": "pagedkv.bench",
    "allocator": "allocator_service.cli",
    "up": "pagedkv.up",
    "credentials": "pagedkv.stack.credentials",
    "worker": "worker.cli",
    "router": "router.cli",
    "demo": "pagedkv.demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="PagedKV: a paged KV-cache memory manager for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
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
    return run_command(args.command, module.run, args)


if __name__ == "__main__":
    sys.exit(main())
