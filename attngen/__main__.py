"""``python -m attngen``: the same command as the ``attngen`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
