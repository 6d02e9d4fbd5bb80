"""``python -m flame.utils.convert_hf_to_dcp``: a Hugging Face model as a step-0 checkpoint (flame.checkpoint.import_hf)."""

import sys

from flame.checkpoint.import_hf import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
