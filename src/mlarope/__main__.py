"""``python -m mlarope`` (see :mod:`mlarope.tools.cli`)."""

import sys

from .tools.cli import main

sys.exit(main())
