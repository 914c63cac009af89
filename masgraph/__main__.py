"""`python -m masgraph`: the `masgraph` command."""

import sys

from masgraph.cli.main import main

sys.exit(main())
