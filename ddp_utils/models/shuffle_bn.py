"""Shuffle BN: the key encoder must not normalise a key with the batch statistics of its own
query's samples, or the model learns to match batches instead of images (MoCo, section 3.3).

Across ranks, the global key batch (W ranks x N images, rank 0's first) is permuted: rank r
encodes global images ``perm[r*N:(r+1)*N]``. Every rank derives the same ``perm`` from (seed, key
batches so far), so nothing is broadcast, and plans its part on the host: one all_to_all moves
each image straight to the rank that encodes it, one all_gather brings all keys back in rank
order. On one process, BatchNorm is split into groups of a locally shuffled batch instead
(:class:`SplitBatchNorm2d`, as in the MoCo authors' CIFAR-10 demo).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import hashing
from ..runtime.collectives import concat_all_gather


def shuffle_permutation(seed: int, count: int, size: int) -> Tensor:
    """The permutation of key batch number ``count`` over ``size`` = W*N global images (CPU)."""
    return hashing.permutation(hashing.key(seed, count), size)


class ShufflePlan(NamedTuple):
    """One rank's part of a cross-rank shuffle; the index tensors are on the training device."""

    send_rows: Tensor        # N: this rank's rows in sending order (grouped by destination rank)
    arrival_slot: Tensor     # N: the shuffled slot of each received row, in arrival order
    unshuffle: Tensor        # W*N: argsort(perm): global image g was encoded at position unshuffle[g]
    send_sizes: list[int]    # W: rows this rank sends to each rank (itself included)
    recv_sizes: list[int]    # W: rows this rank receives from each rank


def plan_shuffle(perm: Tensor, rank: int, world: int, device: torch.device) -> ShufflePlan:
    """Index bookkeeping for ``rank`` on the CPU permutation ``perm`` (W*N): the split sizes
    all_to_all needs as Python ints come from CPU tensors, never from the device."""
    size = perm.numel()
    n = size // world
    unshuffle = torch.empty_like(perm)
    unshuffle[perm] = torch.arange(size)
    # My image i goes to shuffled position unshuffle[r*N + i], on rank position // N; sorted by
    # position, my rows are grouped by destination, each group in its encoding order.
    destination, send_rows = torch.sort(unshuffle[rank * n:(rank + 1) * n])
    # My slot j holds global image perm[r*N + j] of rank perm[...] // N; rows arrive grouped by
    # sender, each group in slot order, so a stable sort by sender gives each arrival's slot.
    source = perm[rank * n:(rank + 1) * n] // n
    _, arrival_slot = torch.sort(source, stable=True)
    counts = torch.stack([torch.bincount(destination // n, minlength=world),
                          torch.bincount(source, minlength=world)])
    send_sizes, recv_sizes = counts.tolist()  # a CPU tensor: no device read
    index = torch.cat([send_rows, arrival_slot, unshuffle])
    if device.type == "cuda":
        index = index.pin_memory()  # so that the copy below is asynchronous
    send_rows, arrival_slot, unshuffle = index.to(device, non_blocking=True).split([n, n, size])
    return ShufflePlan(send_rows, arrival_slot, unshuffle, send_sizes, recv_sizes)


@torch.no_grad()
def shuffle_to_ranks(x: Tensor, plan: ShufflePlan) -> Tensor:
    """This rank's N images of the shuffled global batch (N x ...), in encoding order and in the
    memory format of ``x`` (channels_last stays so): one all_to_all in which each rank sends each
    image to the rank that encodes it."""
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x[plan.send_rows],  # indexing copies, in x's memory format
                           output_split_sizes=plan.recv_sizes, input_split_sizes=plan.send_sizes)
    shuffled = torch.empty_like(received)
    shuffled[plan.arrival_slot] = received
    return shuffled


@torch.no_grad()
def gather_unshuffled(k: Tensor, plan: ShufflePlan) -> Tensor:
    """Every rank's keys (N x C each) in global order, (W*N) x C, the same on every rank."""
    return concat_all_gather(k)[plan.unshuffle]


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over ``num_splits`` groups of the batch (samples i, i+S, i+2S, ...), as
    ``num_splits`` GPUs would normalise. Evaluation uses the running statistics, the mean of the
    groups'. The state-dict keys are those of ``nn.BatchNorm2d``; the output keeps the input's
    memory format (channels_last included)."""

    def __init__(self, num_features: int, num_splits: int, **kwargs):
        super().__init__(num_features, **kwargs)
        self.num_splits = num_splits

    def forward(self, x: Tensor) -> Tensor:
        n, c = x.shape[:2]
        s = self.num_splits
        if not self.training or s == 1:
            return super().forward(x)
        if n % s:
            raise ValueError(f"split BatchNorm: batch {n} is not a multiple of bn_splits {s}")
        if x.is_contiguous():  # NCHW: the groups side by side as channels is a free reshape
            return self._as_channels(x)
        return self._in_layout(x)  # channels_last: no reshape to that shape is a view

    def _as_channels(self, x: Tensor) -> Tensor:
        """N x C x H x W -> N/S x (S*C) x H x W (channel block j: the samples with i % S == j),
        normalised by batch_norm's fused kernel; the running statistics are the blocks' mean."""
        n, c, h, w = x.shape
        s = self.num_splits
        mean_split, var_split = self.running_mean.repeat(s), self.running_var.repeat(s)
        weight, bias = (self.weight.repeat(s), self.bias.repeat(s)) if self.affine else (None, None)
        out = F.batch_norm(x.reshape(n // s, s * c, h, w), mean_split, var_split, weight, bias, True,
                           self.momentum, self.eps)
        with torch.no_grad():
            self.running_mean.copy_(mean_split.view(s, c).mean(0))
            self.running_var.copy_(var_split.view(s, c).mean(0))
            self.num_batches_tracked += 1
        return out.view(n, c, h, w)

    def _in_layout(self, x: Tensor) -> Tensor:
        """The same statistics computed on N/S x S x C x H x W, a view with the input's strides,
        so the output keeps its memory format; in fp32, as batch_norm's kernels for bf16 input."""
        n, c = x.shape[:2]
        s = self.num_splits
        groups = x.unflatten(0, (n // s, s)).float()
        var, mean = torch.var_mean(groups, dim=(0, 3, 4), unbiased=False)  # S x C each
        scale = torch.rsqrt(var + self.eps)
        if self.affine:
            scale = scale * self.weight
        shift = -mean * scale + (self.bias if self.affine else 0)
        out = (groups * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype)
        with torch.no_grad():
            count = groups.numel() // (s * c)  # values per group and channel
            self.running_mean.lerp_(mean.mean(0), self.momentum)
            self.running_var.lerp_((var * count / max(count - 1, 1)).mean(0), self.momentum)  # unbiased
            self.num_batches_tracked += 1
        return out.flatten(0, 1)


def split_batchnorm(module: nn.Module, num_splits: int) -> nn.Module:
    """Replace every BatchNorm2d in ``module`` by a SplitBatchNorm2d with the same state."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, SplitBatchNorm2d):
            split = SplitBatchNorm2d(child.num_features, num_splits, eps=child.eps,
                                     momentum=child.momentum, affine=child.affine)
            split.load_state_dict(child.state_dict())
            setattr(module, name, split.to(child.weight.device))
        else:
            split_batchnorm(child, num_splits)
    return module
