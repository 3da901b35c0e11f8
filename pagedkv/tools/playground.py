"""`pagedkv playground`: the reference article's widget on the real allocator
core, offline: a small web server (no allocator, no worker) serving
`/playground` on loopback until interrupted. An allocator started with
`--playground` serves the same page on its `--metrics-port`, beside `/pools`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from allocator_service.web.app import start_web_server, stop_web_server
from pagedkv_base.settings import CliError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "playground",
        help="serve the article's widget on the real allocator core (offline, in a browser)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only)"
    )
    p.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    return p


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be 0 to 65535 (got {args.port})")
    try:
        httpd = start_web_server(args.port, args.host, playground=True)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"pagedkv playground: open http://{host}:{httpd.server_port}/playground (Ctrl-C to stop)",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    stop_web_server(httpd)
    return 0
