"""`python -m ros` runs the `tensorhub` CLI."""

import sys

from ros.cli import main

sys.exit(main())
