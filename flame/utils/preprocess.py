"""``python -m flame.utils.preprocess``: pretokenize a corpus to disk (flame.tools.preprocess)."""

import sys

if __name__ == "__main__":
    from flame.tools.preprocess import main

    sys.exit(main())
