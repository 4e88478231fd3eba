"""Entry point of the fresh measuring process: ``python -m dptrain.bench._child ...``.

A module of its own so that the package's ``__init__`` has not imported it
before it runs as ``__main__`` (see :func:`dptrain.bench.memory.main`).
"""

from dptrain.bench.memory import main

if __name__ == "__main__":
    main()
