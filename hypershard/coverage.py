"""python -m hypershard.coverage: the operator coverage of a model on a mesh. The command keeps
this name; its code is hypershard.tools.coverage."""

import sys

from .tools.coverage import main

if __name__ == "__main__":
    sys.exit(main())
