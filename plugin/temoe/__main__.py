"""`python -m temoe ...` is the `temoe` command."""

import sys

from temoe.cli import main

sys.exit(main())
