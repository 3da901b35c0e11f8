"""Which build of the core runs (`allocator_service/core/native.py`): the
compiled modules where they were built and are current, else their source,
the same rules either way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import allocator_service
from allocator_service.core import native

ROOT = Path(allocator_service.__file__).resolve().parents[1]
COMPILED = native._compiled_modules()
needs_compiled = pytest.mark.skipif(
    not COMPILED, reason="the core was not compiled here (no C compiler at install)"
)

REPORT = (
    "import warnings; warnings.simplefilter('always');"
    "from allocator_service.core import native, pool, hashing;"
    "print(native.BUILD, pool.__file__.endswith('.py'), hashing.__file__.endswith('.py'))"
)


def _run(pythonpath: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", REPORT],
        env={**os.environ, "PYTHONPATH": str(pythonpath), **env},
        cwd=pythonpath,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy(tmp_path: Path) -> Path:
    """A copy of the package, compiled build and all, its times kept."""
    copy = tmp_path / "allocator_service"
    shutil.copytree(ROOT / "allocator_service", copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@needs_compiled
def test_the_compiled_build_runs_where_it_is_current() -> None:
    assert native.BUILD == "mypyc"
    assert {"pool", "hashing", "prefix_index"} <= set(COMPILED)
    done = _run(ROOT)
    assert done.stdout.split() == ["mypyc", "False", "False"], done.stderr
    assert "older than its source" not in done.stderr


@needs_compiled
def test_pure_python_runs_every_module_as_source() -> None:
    done = _run(ROOT, PAGEDKV_PURE_PYTHON="1")
    assert done.stdout.split() == ["python", "True", "True"], done.stderr


@needs_compiled
def test_a_source_edited_since_the_build_runs_as_source_with_a_warning(tmp_path: Path) -> None:
    """One stale module takes the whole compiled group back to source (the
    compiled modules call each other directly), and says how to rebuild."""
    copy = _copy(tmp_path)
    done = _run(tmp_path)
    assert done.stdout.split() == ["mypyc", "False", "False"], done.stderr
    source = copy / "core" / "pool.py"
    later = (copy / "core" / next(iter(COMPILED.values())).name).stat().st_mtime + 10
    os.utime(source, (later, later))
    done = _run(tmp_path)
    assert done.stdout.split() == ["python", "True", "True"], done.stderr
    assert "the compiled allocator core is older than its source (pool.py)" in done.stderr
    assert "make install" in done.stderr


@needs_compiled
def test_a_build_without_its_shared_library_runs_as_source_with_a_warning(tmp_path: Path) -> None:
    """The compiled modules load one library they share: without it (a
    build that did not finish) the source runs instead of an ImportError."""
    copy = _copy(tmp_path)
    for lib in (copy / "core").glob("*__mypyc*"):
        lib.unlink()
    done = _run(tmp_path)
    assert done.stdout.split() == ["python", "True", "True"], done.stderr
    assert "the compiled allocator core is incomplete" in done.stderr


@needs_compiled
def test_the_core_rules_hold_as_source_too() -> None:
    """Where no C compiler is found (the CPU image) the core runs as source:
    the fast paths' and the Step's property tests pass there as well."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/core/test_fast_paths.py",
            "tests/core/test_step_results.py",
        ],
        env={**os.environ, "PAGEDKV_PURE_PYTHON": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
