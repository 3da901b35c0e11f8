"""The allocator core's hot modules compiled to C with mypyc, where a C
compiler is found: the same source, run without the interpreter's cost per
operation. Without a compiler, or with PAGEDKV_PURE_PYTHON=1 at install, the
package is pure Python and runs the same rules as source
(allocator_service/core/native.py says which one runs)."""

import os
import shutil
import sysconfig

from setuptools import setup

# The core's per-operation and per-block loops: a Step's appends and
# admissions, the hash chain, the prefix index, the tables they change, the
# step's loop over its operations.
COMPILED = [
    f"allocator_service/core/{name}.py"
    for name in (
        "block_hashes",
        "hashing",
        "holdings",
        "planner",
        "pool",
        "prefix_index",
        "run",
        "sequence",
        "validation",
    )
]


def _ext_modules() -> list:
    if os.environ.get("PAGEDKV_PURE_PYTHON") == "1":
        return []
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        print(f"pagedkv: no C compiler ({compiler}); the allocator core stays pure Python")
        return []
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.isfile(headers):
        print(f"pagedkv: no Python headers ({headers}); the allocator core stays pure Python")
        return []
    from mypyc.build import mypycify

    return mypycify(COMPILED, opt_level="3", group_name="allocator_service.core.compiled")


setup(ext_modules=_ext_modules())
