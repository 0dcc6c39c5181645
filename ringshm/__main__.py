"""``python -m ringshm …``: the same command line as the ``ringshm`` console script."""

import sys

from ringshm.cli import main

if __name__ == "__main__":
    sys.exit(main())
