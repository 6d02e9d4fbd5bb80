"""Train with flame, each rank pricing its memory plan from its own rates file, as nodes that measured apart do.

FLAME_TEST_RATES holds rank<N>.json for each rank (flame.memory.hardware's format). Takes
flame.train's arguments and exits as it does (2 bad input, 1 a stop).
"""

import os
import sys

from flame import train

if __name__ == "__main__":
    os.environ["FLAME_HARDWARE"] = os.path.join(os.environ["FLAME_TEST_RATES"], f"rank{os.environ['RANK']}.json")
    sys.exit(train.main())
