"""Weighted k-nearest-neighbour accuracy of frozen features: MoCo's training monitor. Each
validation image votes with its k most similar entries of a bank of the un-augmented training
split's features, weighted by exp(cosine / T) (Wu et al. 2018; the MoCo authors' demo: k=200, T=0.1).

The bank stays sharded (each rank its own rows, M/W x D; bf16 on CUDA). Per step of
``queries_per_step`` validation features, one all_gather gives every rank all queries, each rank
takes its top-k against its shard, and one all_to_all returns the lists to each query's owner, which
merges them and votes: the collectives do not grow with the bank. With an fp32 bank the predictions
are those of a search over the whole gathered bank; ties go to the lower gathered position (rank 0's
rows first), whatever the step and block sizes. The monitor's settings: docs/moco.md.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime.collectives import reduce_metrics
from ..runtime.device import to_device
from ..runtime.dist import get_rank, get_world_size, is_dist
from ..runtime.precision import autocast

_TWO32 = 1 << 32
_NO_NEIGHBOUR = -(1 << 63)  # the smallest int64: a list slot a rank with fewer than k rows cannot fill
# Rows (zero-padded) of every similarity matmul: BLAS rounds very thin ones differently (MKL: under 4
# rows or 12 columns), and equal features must get equal similarities whatever the sharding.
_MIN_MATMUL = 16


def default_bank_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (half the memory; similarities are still computed in fp32), fp32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@torch.no_grad()
def extract_features(backbone: nn.Module, loader: Iterable, device: torch.device,
                     dtype: torch.dtype = torch.float32, amp: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's unit-length features (n x D, normalised in fp32, stored as ``dtype``) and
    labels (n), the backbone run under ``--amp``'s autocast. A loader without samples gives
    0 x 0 and 0. Batches go to the device without a host wait, in its memory format."""
    feats, labels = [], []
    for images, targets in loader:
        images, targets = to_device(images, device), targets.to(device, non_blocking=True)
        with autocast(amp, device):
            out = backbone(images)
        feats.append(F.normalize(out.float(), dim=1).to(dtype))
        labels.append(targets)
    if not feats:
        return torch.empty(0, 0, dtype=dtype, device=device), torch.empty(0, dtype=torch.long, device=device)
    return torch.cat(feats), torch.cat(labels)


# ----------------------------------------------------------------------------- sharded
def _all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` (same shape everywhere) stacked along dim 0 in rank order: one collective."""
    if not is_dist():
        return x
    out = x.new_empty((get_world_size() * x.shape[0], *x.shape[1:]))
    # all_gather_single is the newer name (torch >= 2.12 warns on the old one, which 2.11 needs).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous())
    return out


def _exchange_blocks(x: torch.Tensor) -> torch.Tensor:
    """Block r of dim 0 goes to rank r; block r of the result came from rank r: one collective."""
    if not is_dist():
        return x
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous())
    return out


def _rank_keys(sim: torch.Tensor, first_pos: int) -> torch.Tensor:
    """int64 keys whose order is (similarity, then *lower* bank position): the high 32 bits are
    the fp32 similarity mapped to an int32 of the same order, the low 32 bits 2^32-1-position.
    ``sim`` (n x t, fp32, contiguous; column j is bank position first_pos + j) is overwritten.
    (-0.0 ranks just below +0.0; a dot product of fp32 features is never -0.0 in practice.)"""
    bits = sim.view(torch.int32)
    flip = bits >> 31           # -1 where the sign bit is set (arithmetic shift), else 0
    flip &= 0x7FFFFFFF
    bits ^= flip                # negative floats: reverse the order of their magnitudes
    del flip
    keys = bits.to(torch.int64)
    keys *= _TWO32
    low = _TWO32 - 1 - first_pos
    keys += torch.arange(low, low - sim.shape[1], -1, dtype=torch.int64, device=sim.device)
    return keys


def _similarities(keys: torch.Tensor) -> torch.Tensor:
    """The fp32 similarities back from :func:`_rank_keys`' keys (bit for bit)."""
    high = torch.div(keys, _TWO32, rounding_mode="floor").to(torch.int32)
    return (high ^ ((high >> 31) & 0x7FFFFFFF)).view(torch.float32)


def _vote_weights(top_sim: torch.Tensor, T: float) -> torch.Tensor:
    """exp(similarity / T) up to a positive factor per query: each query's best similarity
    (column 0, lists are sorted) is subtracted first, so a small T cannot overflow fp32."""
    return ((top_sim - top_sim[:, :1]) / T).exp()


def _local_topk(queries: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor, first_pos: int,
                width: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``width`` best keys in this rank's bank shard, and their labels (int32);
    slots beyond the shard's size hold _NO_NEIGHBOUR. The bank goes through in blocks of rows,
    upcast to fp32 one block at a time, so a bf16 bank is never copied whole."""
    keys = torch.full((queries.shape[0], width), _NO_NEIGHBOUR, dtype=torch.int64, device=queries.device)
    labels = torch.zeros((queries.shape[0], width), dtype=torch.int32, device=queries.device)
    for start in range(0, bank.shape[0], block):
        tile = bank[start:start + block].to(torch.float32)             # a no-op for an fp32 bank
        rows = tile.shape[0]
        if rows < _MIN_MATMUL:  # zero rows, cut off again below: see _MIN_MATMUL
            sim = (queries @ torch.cat([tile, tile.new_zeros(_MIN_MATMUL - rows, tile.shape[1])]).T)[:, :rows]
        else:
            sim = queries @ tile.T
        block_keys, idx = _rank_keys(sim.contiguous(), first_pos + start).topk(min(width, rows), dim=1)
        block_labels = bank_labels[start:start + block][idx].to(torch.int32)
        keys, pick = torch.cat([keys, block_keys], dim=1).topk(width, dim=1)
        labels = torch.cat([labels, block_labels], dim=1).gather(1, pick)
    return keys, labels


@torch.no_grad()
def knn_predict_sharded(features: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor,
                        num_classes: int, k: int, T: float, queries_per_step: int = 1024,
                        bank_block: int = 32768) -> torch.Tensor:
    """Predicted labels for this rank's ``features`` (n_r x D, fp32) from the bank sharded over
    the ranks: this rank holds ``bank`` (m_r x D, any float dtype) and ``bank_labels`` (m_r).

    Every rank must call it (a rank with n_r = 0 or m_r = 0 too; an empty shard may be 0 x 0).
    Steps of ``queries_per_step`` queries over all ranks (zero-padded) bound the memory: a step
    holds (W x that / W) x ``bank_block`` similarities, and an int64 key for each.
    """
    device, world, rank = features.device, get_world_size(), get_rank()
    mine = [bank.shape[0], features.shape[0], max(bank.shape[-1], features.shape[-1])]
    sizes = _all_gather_rows(torch.tensor(mine, dtype=torch.int64, device=device)).view(world, 3).tolist()
    bank_sizes, val_sizes = [s[0] for s in sizes], [s[1] for s in sizes]
    dim, total = max(s[2] for s in sizes), sum(bank_sizes)
    if total >= _TWO32 or num_classes >= 2**31:
        raise ValueError(f"bank of {total} rows / {num_classes} classes: positions and labels must fit in 32 bits")
    per_rank = math.ceil(max(queries_per_step, _MIN_MATMUL) / world)
    steps = math.ceil(max(val_sizes) / per_rank)
    n = features.shape[0]
    if total == 0 or steps == 0:  # nothing to search, or nothing to classify (the same on every rank)
        return torch.zeros(n, dtype=torch.long, device=device)  # the argmax of no votes
    k_all, width = min(k, total), min(k, max(bank_sizes))  # global list length, per-rank list length
    first_pos = sum(bank_sizes[:rank])  # this shard's place in the gathered order, for ties
    bank = bank.reshape(-1, dim)
    queries = torch.zeros(steps * per_rank, dim, dtype=torch.float32, device=device)
    queries[:n] = features.reshape(-1, dim)
    preds = torch.empty(steps * per_rank, dtype=torch.long, device=device)
    for step in range(steps):
        rows = slice(step * per_rank, (step + 1) * per_rank)
        everyone = _all_gather_rows(queries[rows])                          # (W x per_rank) x D
        keys, labels = _local_topk(everyone, bank, bank_labels, first_pos, width, bank_block)
        high = torch.div(keys, _TWO32, rounding_mode="floor")                # int32 triples: 12 bytes
        packed = torch.stack([high, keys - high * _TWO32 - 2**31, labels.long()], dim=2).to(torch.int32)
        packed = _exchange_blocks(packed)             # block r: rank r's lists for this rank's queries
        lists = packed.view(world, per_rank, width, 3).transpose(0, 1)      # per_rank x W x width x 3
        cand_keys = (lists[..., 0].long() * _TWO32 + lists[..., 1].long() + 2**31).reshape(per_rank, world * width)
        cand_labels = lists[..., 2].reshape(per_rank, world * width)
        top_keys, pick = cand_keys.topk(k_all, dim=1)                       # sorted by similarity
        top_sim = _similarities(top_keys)
        weights = _vote_weights(top_sim, T)
        votes = torch.zeros(per_rank, num_classes, device=device)
        votes.scatter_add_(1, cand_labels.gather(1, pick).long(), weights)
        preds[rows] = votes.argmax(dim=1)
    return preds[:n]


@torch.no_grad()
def local_bank(backbone: nn.Module, bank_loader: Iterable, device: torch.device,
               dtype: torch.dtype | None = None, amp: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the memory bank (m_r x D in ``dtype``, default
    :func:`default_bank_dtype`) and its labels."""
    return extract_features(backbone, bank_loader, device, dtype or default_bank_dtype(device), amp)


@torch.no_grad()
def knn_accuracy(backbone: nn.Module, bank_loader: Iterable, val_loader: Iterable,
                 num_classes: int, device: torch.device, k: int = 200, T: float = 0.1, *,
                 bank_dtype: torch.dtype | None = None, amp: str = "none", queries_per_step: int = 1024,
                 bank_block: int = 32768) -> float:
    """Top-1 kNN accuracy (%) over the whole validation split, each sample counted once; NaN
    when it is empty. Every rank must call it; each keeps its own shard of ``bank_loader``. Host
    reads: the shard sizes at the start, the correct count and the final sum. ``amp``: the
    precision of the backbone's forward (similarities are fp32 whatever it is)."""
    was_training = backbone.training
    backbone.eval()
    try:
        bank, bank_labels = local_bank(backbone, bank_loader, device, bank_dtype, amp)
        val, val_labels = extract_features(backbone, val_loader, device, amp=amp)  # this rank's shard
    finally:
        backbone.train(was_training)
    preds = knn_predict_sharded(val, bank, bank_labels, num_classes, k, T, queries_per_step=queries_per_step,
                                bank_block=bank_block)
    correct = (preds == val_labels).sum().item()
    total = reduce_metrics({"correct": correct, "count": len(val_labels)}, device)
    return 100.0 * total["correct"] / total["count"] if total["count"] else math.nan
