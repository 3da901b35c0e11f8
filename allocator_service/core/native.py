"""Which build of the core runs: the modules setup.py compiles with mypyc,
or their source.

Both are the same rules: the compiled modules are these very files, built
into C extensions at install where a C compiler is found. The source runs
instead when

- `PAGEDKV_PURE_PYTHON=1` is set (to debug or profile the core line by line),
- nothing was compiled (no C compiler at install), or
- a compiled module is older than its source (edited since the last
  `make install`), or the library the compiled modules share is missing.
  Every compiled module then runs as source, since the compiled ones call
  each other directly, and a warning says how to rebuild.

Imported first by the package, before any module it decides about.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _compiled_modules() -> dict[str, Path]:
    """Each module of this package that has a compiled build beside its
    source: name -> the extension file."""
    found = {}
    for ext in _HERE.glob("*" + _SUFFIX):
        name = ext.name[: -len(_SUFFIX)]
        if (_HERE / f"{name}.py").is_file():
            found[name] = ext
    return found


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Finds the source of each named module of this package, ahead of the
    extension the default finder would load."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(self, fullname, path, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __package__ and name in self.names:
            return importlib.util.spec_from_file_location(fullname, _HERE / f"{name}.py")
        return None


def _choose() -> str:
    compiled = _compiled_modules()
    if not compiled:
        return "python"
    if os.environ.get("PAGEDKV_PURE_PYTHON") == "1":
        reason = None
    elif not any(_HERE.glob("*__mypyc" + _SUFFIX)):
        # the library the compiled modules share is missing: a build that did not finish
        reason = "the compiled allocator core is incomplete (no *__mypyc library)"
    else:
        stale = sorted(
            n
            for n, ext in compiled.items()
            if (_HERE / f"{n}.py").stat().st_mtime > ext.stat().st_mtime
        )
        if not stale:
            return "mypyc"
        reason = f"the compiled allocator core is older than its source ({', '.join(stale)}.py)"
    sys.meta_path.insert(0, _SourceFirst(frozenset(compiled)))
    if reason:
        warnings.warn(
            f"{reason}; running the source. `make install` (or `pip install -e .`) "
            "compiles it again",
            RuntimeWarning,
            stacklevel=1,
        )
    return "python"


# "mypyc": the compiled modules run; "python": every module runs as source.
BUILD = _choose()
