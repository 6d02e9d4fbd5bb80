"""``python -m flame.utils.preprocess``: pretokenize a corpus to disk (flame.tools.preprocess)."""

import sys

from flame.tools.preprocess import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
