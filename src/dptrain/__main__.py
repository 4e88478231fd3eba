"""``python -m dptrain``: the ``dptrain`` command (:func:`dptrain.cli.main`)."""

import sys

from dptrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
