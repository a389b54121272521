"""``python -m hone``: the ``hone`` command (what ``torchrun -m hone train CFG`` runs in each process)."""

import sys

from hone.cli import main

if __name__ == "__main__":
    sys.exit(main())
