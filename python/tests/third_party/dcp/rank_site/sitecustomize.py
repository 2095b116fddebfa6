"""Installs ShmckptWriter/ShmckptReader (../shmckpt_dcp_swap.py) in a rank that DCP's
multi-process test cases spawn, before the rank imports the test module (which binds
FileSystemWriter/FileSystemReader at import). shmckpt's own file.

The plugin's fixture puts this directory on ``PYTHONPATH`` for the duration of one of
DCP's tests, and sets ``SHMCKPT_DCP_SWAP_LOG`` (``shmckpt_dcp_swap.RANKS_ENV``): every
Python process started meanwhile runs this at start-up. It shadows any other
``sitecustomize`` in those processes only.
"""

import os
import sys

if os.environ.get("SHMCKPT_DCP_SWAP_LOG"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import shmckpt_dcp_swap

    shmckpt_dcp_swap.install()
