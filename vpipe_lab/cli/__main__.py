"""``python -m vpipe_lab.cli``: the `vpipe-lab` command."""

import sys

from vpipe_lab.cli.main import main

sys.exit(main())
