"""``python -m tiering``: the ``tiering`` command."""

import sys

from tiering.cli import main

sys.exit(main())
