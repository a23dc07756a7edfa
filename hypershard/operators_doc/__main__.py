"""python -m hypershard.operators_doc: see the package docstring."""

import sys

from . import main

sys.exit(main())
