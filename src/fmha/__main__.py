"""``python -m fmha``: the ``fmha`` command line (see ``fmha.cli``)."""

import sys

from fmha.cli import main

if __name__ == "__main__":  # spawned workers import this module too; they must not run main
    sys.exit(main())
