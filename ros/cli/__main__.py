"""`python -m ros.cli` runs the `tensorhub` CLI."""

import sys

from ros.cli import main

sys.exit(main())
