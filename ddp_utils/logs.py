"""Rank-aware logging: INFO and up on rank 0, WARNING and up on the other ranks."""
from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(message)s"


def setup_logging(rank: int, debug: bool = False) -> logging.Logger:
    """Configure the root logger once per process; other ranks still show their warnings."""
    level = logging.DEBUG if debug else logging.INFO
    if rank != 0:
        level = logging.WARNING
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger("train")
