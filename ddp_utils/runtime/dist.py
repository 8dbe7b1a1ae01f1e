"""The process group: :func:`init_distributed` for torchrun, srun or a single process (the
launch from ``launch``, the device and backend from ``device``), :func:`cleanup_distributed`,
the rank helpers, DDP and ``torch.compile`` around the network (:func:`wrap_network`) and
:func:`unwrap`.

Every helper here also works when no process group exists, so the same training code runs
unchanged in a debugger.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .device import select_device
from .launch import detect_launch


@dataclass(frozen=True)
class DistInfo:
    """The distributed context of this process, returned by :func:`init_distributed`."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None when running as one process without a process group
    launcher: str
    node: str = "0"  # which node of the job (``launch.node_identity``): a node's ranks share its cache of shards

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", timeout_s: float = 600.0,
                     env: Mapping[str, str] | None = None) -> DistInfo:
    """Initialise the process group for torchrun, srun or a single process.

    ``timeout_s`` bounds every collective: a peer that died makes the others fail after this many
    seconds instead of hanging the job until its wall-clock limit. A device that cannot work
    raises :class:`UsageError` before any rendezvous (``device.check_device``).
    """
    launch = detect_launch(env)
    torch_device, backend = select_device(device, launch)
    if launch.world_size == 1:
        return DistInfo(0, 0, 1, 1, torch_device, None, launch.launcher, launch.node)
    if not dist.is_initialized():
        if launch.launcher == "torchrun":
            init_method = "env://"  # torchrun may hand over a TCPStore; env:// reuses it
        else:
            init_method = f"tcp://{_bracket_ipv6(launch.master_addr)}:{launch.master_port}"
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch_device if backend == "nccl" else None,
        )
    return DistInfo(launch.rank, launch.local_rank, launch.world_size,
                    launch.local_world_size, torch_device, backend, launch.launcher, launch.node)


def _bracket_ipv6(host: str | None) -> str:
    if host is None:
        raise RuntimeError("no master address: set MASTER_ADDR or launch with torchrun/srun")
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module under DistributedDataParallel and torch.compile (what checkpoints store)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's wrapper
            model = model._orig_mod
        else:
            return model


def cleanup_distributed() -> None:
    """Leave the process group together (on gloo, a bounded barrier first). Call it once
    no DistributedDataParallel model is referenced any more (a DDP reducer that is the group's last
    holder can deadlock its destruction: pytorch/pytorch#56297). Why both: docs/running.md,
    "Leaving the process group"."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        if dist.get_backend() == "gloo":
            with contextlib.suppress(RuntimeError):  # a missing peer: leave anyway
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        dist.destroy_process_group()


# Rank helpers: valid before, after and without init_process_group.
def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_dist():
        dist.barrier()


def wrap_network(module: nn.Module, info: DistInfo, compile: bool) -> nn.Module:
    """DDP around ``module`` when distributed, then torch.compile when asked. Every rank must
    call it (DDP broadcasts rank 0's weights). Gradients live in DDP's all-reduce buckets
    (``gradient_as_bucket_view``): one copy of them fewer. The compiled wrapper forwards
    attributes: DDP's ``no_sync``."""
    if info.is_distributed:
        module = DDP(module, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                     gradient_as_bucket_view=True)
    return torch.compile(module) if compile else module
