"""``python -m mlarope.tools.bench.serving``: the serving benchmark (see the package)."""

import sys

from . import main

sys.exit(main())
