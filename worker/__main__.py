"""`python -m worker ...` is `pagedkv worker ...`."""

import sys

from pagedkv.cli import main

sys.exit(main(["worker", *sys.argv[1:]]))
