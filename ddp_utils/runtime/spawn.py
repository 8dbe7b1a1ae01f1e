"""Start N local processes set up the way torchrun sets up its workers (for tests and benchmarks)."""
from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    fn(rank, *args)


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any, start_method: str = "spawn",
                port: int | None = None) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` processes with torchrun's environment variables
    (``port`` on 127.0.0.1, by default a free one); ``init_distributed()`` in ``fn`` then forms
    the group. ``fn`` must be importable (module level). Raises if any process fails. ``start_method``
    "forkserver" forks each process from one server that imported the modules given to
    ``multiprocessing.set_forkserver_preload`` once, instead of starting a fresh interpreter
    each time."""
    mp.start_processes(_entry, args=(fn, world_size, port or free_port(), args), nprocs=world_size,
                       join=True, start_method=start_method)

