"""python -m nodeserve."""

import sys

from nodeserve.cli import main

sys.exit(main())
