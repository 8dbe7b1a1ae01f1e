"""Collectives with a world-size-1 path, so callers never test for a process group themselves."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..config import UsageError
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


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable), on every rank."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@contextlib.contextmanager
def all_ranks_agree() -> Iterator[None]:
    """Run a block of checks on every rank; a :class:`UsageError` on *any* rank is raised on
    *every* rank when the block ends, so all of them exit 2 together and none waits for a peer
    that already left. The block must run no collective itself (a rank that raised skips the
    rest of it). A rank whose error it is not raises a copy naming the rank it came from.
    """
    problem = None
    try:
        yield
    except UsageError as err:
        problem = (str(err), err.said, err.exit_code)
    problems = all_gather_object(problem)
    for rank, found in enumerate(problems):
        if found is not None:
            text, said, code = found
            raise UsageError(text if rank == 0 else f"(rank {rank}) {text}", said, code)


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``src``'s values, in place."""
    if is_dist():
        dist.broadcast(tensor, src=src)
    return tensor


@torch.no_grad()
def broadcast_coalesced_(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite each of ``tensors`` with rank ``src``'s values, in place: one broadcast per dtype
    and device (a flat copy of them all), not one per tensor."""
    if not is_dist():
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src=src)
        for tensor, part in zip(group, flat.split([t.numel() for t in group])):
            tensor.copy_(part.view_as(tensor))


@torch.no_grad()
def sync_buffers_from_rank0(module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics): after the last training forward
    each rank holds its own, and evaluation should score one model, the one rank 0 saves."""
    for buffer in module.buffers():
        broadcast_(buffer, src=0)


def state_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over named tensors (names, dtypes and bytes)."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in tensors.items():
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy: its buffer
    return digest.hexdigest()


def check_replicas_identical(tensors: dict[str, torch.Tensor]) -> str:
    """Raise if the named tensors differ between ranks; return their digest.

    Cheap insurance at the end of a run: DDP keeps gradients in step, but state updated outside
    it (a momentum encoder, a queue) could silently diverge. BatchNorm running statistics are
    left out on purpose: each rank updates its own during forward (DDP re-broadcasts rank 0's
    at the next forward), so they legitimately differ after the last step.
    """
    digests = all_gather_object(state_digest(tensors))
    if len(set(digests)) != 1:
        raise RuntimeError(f"state differs between ranks: {digests}")
    return digests[0]
