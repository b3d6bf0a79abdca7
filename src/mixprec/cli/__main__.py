"""`python -m mixprec.cli ...`: the `mixprec` command."""

import sys

from mixprec.cli import main

sys.exit(main())
