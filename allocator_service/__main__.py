import sys

from allocator_service.cli import main

sys.exit(main())
