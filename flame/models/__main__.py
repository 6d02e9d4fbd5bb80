"""``python -m flame.models``: the support table (flame.models.support_table)."""

import sys

from flame.models.support_table import main

sys.exit(main())
