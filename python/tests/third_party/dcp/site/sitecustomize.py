"""Installs the swap (../swap.py) in every Python process of a run of DCP's tests,
including the rank processes their test cases spawn, when SHMCKPT_DCP_SWAP=1."""

import os
import sys

if os.environ.get("SHMCKPT_DCP_SWAP") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import swap

    swap.install()
