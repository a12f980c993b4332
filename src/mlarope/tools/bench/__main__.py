"""``python -m mlarope.tools.bench`` (the same as ``python -m mlarope bench``)."""

import sys

from .cli import main

sys.exit(main())
