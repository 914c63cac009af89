"""`python -m masgraph.cli`: the `masgraph` command."""

import sys

from masgraph.cli.main import main

sys.exit(main())
