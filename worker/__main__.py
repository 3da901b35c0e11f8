"""`python -m worker ...` is `pagedkv worker ...` (without importing the umbrella)."""

import sys

from worker.cli import main

sys.exit(main())
