"""python -m hypershard.demo: the 4-rank demo run by make demo. The command keeps this name; its
code is hypershard.tools.demo."""

import sys

from .tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
