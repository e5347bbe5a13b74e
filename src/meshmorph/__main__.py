"""``python -m meshmorph``: the console script ``meshmorph``."""

import sys

from meshmorph.cli import main

sys.exit(main())
