"""``python -m shardkit``: the same command line as the ``shardkit`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
