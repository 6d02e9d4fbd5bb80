"""``python -m flame.utils.convert_dcp_to_hf``: a DCP checkpoint as a Hugging Face model (flame.checkpoint.export)."""

import sys

if __name__ == "__main__":
    from flame.compat.transformers import scikit_learn_imported_when_used

    scikit_learn_imported_when_used()  # before transformers' model classes load

from flame.checkpoint.export import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
