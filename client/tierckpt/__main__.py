"""`python -m tierckpt` runs the CLI."""

import sys

from tierckpt.cli import main

sys.exit(main())
