"""``python -m mlarope`` (see :mod:`mlarope.cli`)."""

import sys

from .cli import main

sys.exit(main())
