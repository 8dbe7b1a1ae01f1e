"""Rank-aware logging: INFO and up on rank 0, WARNING and up on the other ranks.

While a run starts, records are held back: a start that ends in a bad-input error shows only
that error's one line; a start that succeeds shows them all, in order.
"""
from __future__ import annotations

import logging
import logging.handlers
import sys

_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(message)s"


def setup_logging(rank: int, debug: bool = False, hold: bool = False) -> logging.Logger:
    """Configure the root logger once per process; other ranks still show their warnings.
    ``hold``: keep records until :func:`release_held_logs`."""
    level = logging.DEBUG if debug else logging.INFO
    if rank != 0:
        level = logging.WARNING
    handler: logging.Handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    if hold:
        handler = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1,
                                                 target=handler, flushOnClose=False)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger("train")


def release_held_logs(show: bool) -> None:
    """Print (``show``) or drop the held records, and log directly from now on."""
    root = logging.getLogger()
    for i, handler in enumerate(root.handlers):
        if isinstance(handler, logging.handlers.MemoryHandler):
            if show:
                handler.flush()
            root.handlers[i] = handler.target
