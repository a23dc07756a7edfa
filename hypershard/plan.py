"""python -m hypershard.plan: the mesh planner (hypershard/planner/). The command keeps this name;
its code is hypershard.planner.cli."""

import sys

from .planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
