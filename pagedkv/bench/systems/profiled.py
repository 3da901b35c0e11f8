"""A process with every thread under cProfile: `python -m pagedkv.bench.systems.profiled
OUT MODULE [ARGS...]` runs `python -m MODULE ARGS...` with each thread it
starts (a gRPC server's handlers run in its pool's threads) under a profiler
of its own, timed in the thread's CPU time (a thread waiting costs nothing),
and writes their stats merged to OUT (pstats) when the module returns (an
allocator: on SIGTERM). The main thread, which only starts the server and
waits, is not profiled. `ProfiledAllocator` starts an allocator so.
"""

from __future__ import annotations

import cProfile
import pstats
import runpy
import sys
import threading
import time

from pagedkv.stack.services import AllocatorProcess


class ProfiledAllocator(AllocatorProcess):
    """An allocator process whose profile is written to `out` when it stops."""

    def __init__(self, out: str, args=(), **kw) -> None:
        super().__init__(args, **kw)
        self.out = out

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            __name__,
            self.out,
            "allocator_service",
            "--listen",
            self.listen,
            *self.args,
        ]


def main(argv: list[str]) -> int:
    out, module, *args = argv
    profiles: list[cProfile.Profile] = []
    run = threading.Thread.run

    def profiled(thread: threading.Thread) -> None:
        profile = cProfile.Profile(time.thread_time)
        profiles.append(profile)
        profile.runcall(run, thread)

    threading.Thread.run = profiled  # type: ignore[method-assign]
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    finally:
        pstats.Stats(*profiles).dump_stats(out)
    return code


if __name__ == "__main__":  # pragma: no cover - a child process
    sys.exit(main(sys.argv[1:]))
