"""PyTorch DCP's own storage tests (vendored, ../README.md) with ShmckptWriter and
ShmckptReader swapped in. shmckpt's file, not PyTorch's.

The ranks that DCP's multi-process test cases spawn import this package before the test
module (to find the test class): there, the swap is installed first, so that the test
module binds the swapped classes (see shmckpt_swap.py). In pytest's own process the
conftest swaps per test instead, and nothing happens here.
"""

import os

if os.environ.get("SHMCKPT_DCP_SWAP_LOG"):  # shmckpt_swap.RANKS_ENV, set for a test's ranks
    from . import shmckpt_swap

    shmckpt_swap.install()
