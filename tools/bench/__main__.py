"""``python -m tools.bench [NAME] ...``: see :mod:`tools.bench.cli`."""

import sys

from tools.bench.cli import main

sys.exit(main())
