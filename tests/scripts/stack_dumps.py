"""flame's stack dumps: arranged, then this process waits where the dump must point.

    python tests/scripts/stack_dumps.py signal   sends itself SIGUSR2 (flame.base.process.STACK_DUMP_SIGNAL)
    python tests/scripts/stack_dumps.py sleep    sleeps 3 s (the test sets FLAME_DUMP_STACKS_AT, or not)

Then prints "still running": a dump must not end the process. test_train_sh.py checks stderr for
the stack (every thread's, pointing at this file's os.kill or time.sleep line) and stdout.
"""

import os
import signal
import sys
import time

from flame.train import arrange_stack_dumps

arrange_stack_dumps()
if sys.argv[1] == "signal":
    os.kill(os.getpid(), signal.SIGUSR2)
else:
    time.sleep(3)
print("still running")
