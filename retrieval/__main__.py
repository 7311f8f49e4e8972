"""``python -m retrieval ...`` runs the ``retrieval`` command from any folder (``torchrun ... -m retrieval train``)."""

from retrieval.cli.main import main

if __name__ == "__main__":
    main()
