"""python -m hypershard.tools.operators_doc: see the package docstring."""

import sys

from . import main

sys.exit(main())
