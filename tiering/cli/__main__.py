"""``python -m tiering.cli``: the ``tiering`` command, as ``python -m tiering`` runs it."""

import sys

from tiering.cli.entry import main

sys.exit(main())
