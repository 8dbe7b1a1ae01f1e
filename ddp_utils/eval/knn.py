"""Weighted k-nearest-neighbour accuracy of frozen features: MoCo's training monitor.

The memory bank is the (un-augmented) training split's features; each validation image votes with
its k most similar bank entries, weighted by exp(cosine / T) (Wu et al. 2018, as in the MoCo
authors' CIFAR demo: k=200, T=0.1).

:func:`knn_accuracy` searches a *sharded* bank: each rank keeps only the bank rows it extracted
(M/W x D; bf16 on CUDA, fp32 on CPU by default) and never sees the others. The validation
features go round in steps of ``queries_per_step`` (all ranks together): one all_gather hands
every rank all ranks' queries of the step, each rank takes its own top-k of them against its
shard, and one all_to_all returns every list to the rank that owns the query, which merges the W
lists into the global top-k and votes. Per pass: 1 + 2 x steps + 1 collectives, whatever the bank
size (the first agrees on the sizes, the last sums the counts); one host sync, at the start.

Why all_gather + all_to_all: broadcasting each rank's chunk in turn needs W broadcasts per step
(and gathering the lists to each owner in turn W more); an all_gather of equal, zero-padded chunks
moves the same bytes in one collective, and so does one all_to_all for the lists (each rank
receives only the lists of its own queries, not everyone's).

:func:`knn_accuracy_gathered` is the previous implementation (the whole bank gathered on every
rank, fp32), kept as the reference for tests and ``bench/knn.py``.

Exactness and ties. With the bank stored in fp32 the sharded search selects the same neighbours
and casts the same votes as the gathered one: similarities are the same fp32 matmul, the merged
list is sorted by similarity as ``torch.topk``'s is, and the vote code is the same. Two caveats.
(1) A BLAS may round a dot product differently in a very thin matrix (MKL: under 4 rows or 12
columns, ~1e-7); the gathered search meets one when its last query chunk has 1-3 rows, the
sharded one never (it pads). That changes a prediction only when two neighbours, or two classes'
votes, are that close. (2) Ties: ``torch.topk`` does not say which of several equal similarities
it keeps (on CPU neither the first nor the last), so the gathered search's choice at the k-th
place is unspecified and cannot be reproduced. The sharded search breaks ties by the lower bank
position in the gathered order (rank 0's rows first, each rank's in loader order): the same
result for any ``queries_per_step`` and ``bank_block``. Ties only arise between exact duplicates,
and matter only when such copies carry different labels at the k-th place; equality tests use
tie-free data. The rule costs an int64 key per similarity (on CPU at D=512 the search takes
~1.2-1.5x the gathered one's time; see bench/knn.py).

A bf16 bank differs from the fp32 one by the rounding of the bank features only (queries and
similarities stay fp32); it is exact against the gathered search over the same bf16-rounded bank.
On CUDA the vote's ``scatter_add_`` is atomic, in both versions, so votes agree to float rounding.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from ..runtime.collectives import all_gather_object, concat_all_gather, reduce_metrics
from ..runtime.dist import get_rank, get_world_size, is_dist

_TWO32 = 1 << 32
_NO_NEIGHBOUR = -(1 << 63)  # the smallest int64: a list slot a rank with fewer than k rows cannot fill
# BLAS libraries hand very thin matrices to other kernels, which round dot products differently
# (MKL: under 4 rows or under 12 columns, ~1e-7). Every similarity matmul here has at least this
# many query rows and bank rows (zero-padded), so copies of one feature get bit-identical
# similarities whatever the shard, step and block sizes, and only the tie rule tells them apart.
_MIN_MATMUL = 16


def default_bank_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (half the memory; similarities are still computed in fp32), fp32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@torch.no_grad()
def extract_features(backbone: nn.Module, loader: DataLoader, device: torch.device,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's unit-length features (n x D, normalised in fp32, stored as ``dtype``) and
    labels (n). A loader without samples gives 0 x 0 and 0."""
    feats, labels = [], []
    for images, targets in loader:
        feats.append(F.normalize(backbone(images.to(device)).float(), dim=1).to(dtype))
        labels.append(targets.to(device))
    if not feats:
        return torch.empty(0, 0, dtype=dtype, device=device), torch.empty(0, dtype=torch.long, device=device)
    return torch.cat(feats), torch.cat(labels)


# ----------------------------------------------------------------------------- gathered (reference)
@torch.no_grad()
def gather_uneven(x: torch.Tensor) -> torch.Tensor:
    """Concatenate tensors whose first dimension differs between ranks (padded all_gather)."""
    sizes = all_gather_object(x.shape[0])
    padded = torch.zeros((max(sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    gathered = concat_all_gather(padded).view(len(sizes), max(sizes), *x.shape[1:])
    return torch.cat([gathered[r, :n] for r, n in enumerate(sizes)])


@torch.no_grad()
def knn_predict(features: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor,
                num_classes: int, k: int, T: float, chunk: int = 256) -> torch.Tensor:
    """Predicted labels for ``features`` (n x D) from the bank (M x D), in chunks to bound memory."""
    k = min(k, bank.shape[0])
    preds = []
    for start in range(0, features.shape[0], chunk):
        sim = features[start:start + chunk] @ bank.T                      # c x M
        top_sim, top_idx = sim.topk(k, dim=1)                               # c x k
        weights = (top_sim / T).exp()
        votes = torch.zeros(sim.shape[0], num_classes, device=sim.device)
        votes.scatter_add_(1, bank_labels[top_idx], weights)                # c x classes
        preds.append(votes.argmax(dim=1))
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=features.device)


@torch.no_grad()
def knn_accuracy_gathered(backbone: nn.Module, bank_loader: DataLoader, val_loader: DataLoader,
                          num_classes: int, device: torch.device, k: int = 200, T: float = 0.1) -> float:
    """The previous :func:`knn_accuracy`: the whole train split's features (fp32) gathered on
    every rank (M x D each: ~10 GB at ImageNet size). Kept as the reference."""
    was_training = backbone.training
    backbone.eval()
    bank, bank_labels = extract_features(backbone, bank_loader, device)
    bank, bank_labels = gather_uneven(bank), gather_uneven(bank_labels)  # the full train split
    val, val_labels = extract_features(backbone, val_loader, device)     # this rank's shard
    backbone.train(was_training)
    correct = (knn_predict(val, bank, bank_labels, num_classes, k, T) == val_labels).sum().item()
    total = reduce_metrics({"correct": correct, "count": len(val_labels)}, device)
    return 100.0 * total["correct"] / total["count"]


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
    Steps of ``queries_per_step`` validation queries over all ranks (ceil(queries_per_step / W)
    per rank, zero-padded) bound the memory: a step holds (W x that) x ``bank_block``
    similarities, plus an int64 key for each. Equal to :func:`knn_predict` over the gathered bank
    (see the module docstring for ties). No process group: no collectives.
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
        return torch.zeros(n, dtype=torch.long, device=device)  # knn_predict's argmax of no votes
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
        top_keys, pick = cand_keys.topk(k_all, dim=1)                       # sorted, like knn_predict's
        top_sim = _similarities(top_keys)
        weights = (top_sim / T).exp()
        votes = torch.zeros(per_rank, num_classes, device=device)
        votes.scatter_add_(1, cand_labels.gather(1, pick).long(), weights)
        preds[rows] = votes.argmax(dim=1)
    return preds[:n]


@torch.no_grad()
def local_bank(backbone: nn.Module, bank_loader: DataLoader, device: torch.device,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the memory bank: (m_r x D in ``dtype``, default
    :func:`default_bank_dtype`), and its labels. All :func:`knn_accuracy` keeps of the bank."""
    return extract_features(backbone, bank_loader, device, dtype or default_bank_dtype(device))


@torch.no_grad()
def knn_accuracy(backbone: nn.Module, bank_loader: DataLoader, val_loader: DataLoader,
                 num_classes: int, device: torch.device, k: int = 200, T: float = 0.1, *,
                 bank_dtype: torch.dtype | None = None, queries_per_step: int = 1024,
                 bank_block: int = 32768) -> float:
    """Top-1 kNN accuracy (%) over the whole validation split, each sample counted once.

    Each rank extracts and keeps its own shard of ``bank_loader`` (stored as ``bank_dtype``:
    default bf16 on CUDA, fp32 on CPU) and the search is sharded (:func:`knn_predict_sharded`).
    Every rank must call it. NaN when the validation split is empty.
    """
    was_training = backbone.training
    backbone.eval()
    try:
        bank, bank_labels = local_bank(backbone, bank_loader, device, bank_dtype)
        val, val_labels = extract_features(backbone, val_loader, device)  # this rank's shard
    finally:
        backbone.train(was_training)
    preds = knn_predict_sharded(val, bank, bank_labels, num_classes, k, T, queries_per_step=queries_per_step,
                                bank_block=bank_block)
    correct = (preds == val_labels).sum().item()
    total = reduce_metrics({"correct": correct, "count": len(val_labels)}, device)
    return 100.0 * total["correct"] / total["count"] if total["count"] else math.nan


# ----------------------------------------------------------------------------- a cheaper bank
def _splitmix64(x):
    """SplitMix64's finaliser on a numpy uint64 array (wrapping arithmetic is defined there)."""
    import numpy as np

    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def bank_subset(train_dataset: Dataset, n: int, seed: int) -> Subset:
    """A fixed subset of ``n`` samples of ``train_dataset`` for a cheaper kNN bank (all of it
    when ``n >= len``), indices in increasing order.

    A function of (len, n, seed) alone: the same on every rank, for any world size, and across
    runs, resumes and library versions (each index gets a SplitMix64 hash of (seed, index), the
    ``n`` smallest win; no RNG stream whose algorithm could change). A larger ``n`` with the same
    seed gives a superset.
    """
    import numpy as np

    size = len(train_dataset)  # type: ignore[arg-type]
    if n < 0:
        raise ValueError(f"bank_subset: n must be >= 0, got {n}")
    if n >= size:
        return Subset(train_dataset, list(range(size)))
    with np.errstate(over="ignore"):
        scores = _splitmix64(_splitmix64(np.array([seed], dtype=np.int64).astype(np.uint64))
                             ^ np.arange(size, dtype=np.uint64))
    chosen = np.sort(np.argsort(scores, kind="stable")[:n])
    return Subset(train_dataset, chosen.tolist())
