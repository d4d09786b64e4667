"""``python -m edgemesh``: the ``edgemesh`` command (how the local tools start their child processes)."""

import sys

from edgemesh.cli import main

sys.exit(main())
