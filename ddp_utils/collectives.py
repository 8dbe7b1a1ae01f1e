"""Collectives with a world-size-1 path, so callers never test for a process group themselves."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .dist import get_world_size, is_dist


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place, and return it."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def reduce_metrics(sums: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum a dict of Python numbers over ranks with one all_reduce (float64, so counts stay exact)."""
    keys = sorted(sums)
    packed = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device)
    all_reduce_sum(packed)
    return dict(zip(keys, packed.tolist()))


@torch.no_grad()
def concat_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dim 0, in rank order.

    ``dist.all_gather`` has no autograd: the result never carries a gradient, which is what the
    MoCo key path and the kNN monitor want. Every rank must pass the same shape.
    """
    if not is_dist():
        return tensor.detach()
    gathered = [torch.empty_like(tensor) for _ in range(get_world_size())]
    dist.all_gather(gathered, tensor.detach().contiguous())
    return torch.cat(gathered, dim=0)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``src``'s values, in place."""
    if is_dist():
        dist.broadcast(tensor, src=src)
    return tensor
