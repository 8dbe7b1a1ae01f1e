"""MoCo: Momentum Contrast (He et al. 2020, v1; Chen et al. 2020, "Improved Baselines", v2).

One module holds everything MoCo keeps between steps:

* ``encoder_q``  backbone + projection head, trained by SGD. Only this encoder is wrapped in DDP
  (by the training script), so DDP never broadcasts the queue or the key encoder.
* ``encoder_k``  a copy of ``encoder_q`` with ``requires_grad=False``: never in DDP, never in the
  optimizer, moved only by :meth:`MoCo.momentum_update` (``k = m*k + (1-m)*q``), once per
  optimizer step, on every rank, so it stays identical everywhere.
* ``queue``      dim x K unit-length keys of past batches from *all* ranks, and ``queue_ptr``.
  Both are registered buffers: they live in checkpoints. They only ever hold detached tensors,
  and every rank writes the same all_gathered keys, so the queue is identical on every rank.

The module holds state and computes features; the losses are plain functions of them.
:meth:`MoCo.queries` (query features, with a graph), :meth:`MoCo.keys_and_global` (key features,
none) and :meth:`MoCo.negatives` (the queue, detached) feed :func:`info_nce` (logits) and
:func:`contrastive_loss` (cross-entropy, accuracy). :meth:`MoCo.forward` is the asymmetric loss's
input (q1 against k2); :meth:`MoCo.symmetric_forward` builds both directions from the same parts
for ``--symmetric`` (:func:`symmetric_contrastive_loss`, as the MoCo authors' CIFAR-10 demo).

BatchNorm: a key encoder that normalises over the same samples as the query encoder lets the
model "cheat" (the positive pair shares batch statistics). Shuffle BN blocks that: across ranks,
key images are shuffled between ranks before the key encoder and un-shuffled after; on one
process, BatchNorm is split into ``bn_splits`` groups and the key batch is shuffled locally.
Across ranks the permutation is not communicated: every rank derives the same one on the CPU from
(``shuffle_seed``, the count of distributed key batches so far), see :func:`shuffle_permutation`.
The data movement per key batch (N images per rank, W ranks) is then one all_to_all in which each
rank passes each of its N images to the rank that will encode it and receives exactly the N it
encodes (no rank ever holds the global image batch; the images it keeps are a local copy), and
one all_gather of the N x C keys, whose (W*N) x C result un-shuffles this rank's keys *and* is
what the queue takes (``keys_and_global`` + ``enqueue(..., gathered=True)``). All of it is
key-encoder work under no_grad: no gradient crosses a rank boundary here, and nothing in it reads
a device tensor back to the host.
The key encoder's BatchNorm running statistics are its own (from its own forward passes in
train mode), not an EMA of the query encoder's buffers, and they are per rank (no DDP broadcasts
them; checkpoints keep rank 0's). Training never reads them: the key encoder always normalises
with batch statistics, as in the MoCo authors' code.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime.collectives import broadcast_, concat_all_gather
from ..runtime.dist import get_rank, get_world_size, is_dist

_MASK64 = (1 << 64) - 1


class Encoder(nn.Module):
    """A backbone (classifier with ``fc`` removed) followed by a projection head."""

    def __init__(self, backbone: nn.Module, feature_dim: int, out_dim: int, mlp: bool):
        super().__init__()
        self.backbone = backbone
        if mlp:  # v2: a 2-layer MLP head
            self.head = nn.Sequential(nn.Linear(feature_dim, feature_dim), nn.ReLU(inplace=True),
                                      nn.Linear(feature_dim, out_dim))
        else:    # v1: one linear layer
            self.head = nn.Linear(feature_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over ``num_splits`` interleaved groups of the batch (samples i, i+S, i+2S, ...).

    Emulates ``num_splits`` GPUs' separate batch statistics on one device (the MoCo authors'
    CIFAR demo does the same). Evaluation uses the ordinary running statistics, which are the
    mean of the groups'. The state-dict keys are those of ``nn.BatchNorm2d``.
    """

    def __init__(self, num_features: int, num_splits: int, **kwargs):
        super().__init__(num_features, **kwargs)
        self.num_splits = num_splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        s = self.num_splits
        if not self.training or s == 1:
            return super().forward(x)
        if n % s:
            raise ValueError(f"split BatchNorm: batch {n} is not a multiple of bn_splits {s}")
        mean_split, var_split = self.running_mean.repeat(s), self.running_var.repeat(s)
        # N x C x H x W -> N/S x (S*C) x H x W: channel block j holds the samples with i % S == j.
        out = F.batch_norm(x.reshape(n // s, s * c, h, w), mean_split, var_split,
                           self.weight.repeat(s), self.bias.repeat(s), True, self.momentum, self.eps)
        with torch.no_grad():
            self.running_mean.copy_(mean_split.view(s, c).mean(0))
            self.running_var.copy_(var_split.view(s, c).mean(0))
            self.num_batches_tracked += 1
        return out.view(n, c, h, w)


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


class Keys(NamedTuple):
    """One key batch, unit length, detached: this rank's keys and every rank's, in global order."""

    local: torch.Tensor      # N x C: the keys of this rank's own key images, in its order
    all_ranks: torch.Tensor  # (W*N) x C: rank 0's N keys, then rank 1's, ...; identical on every rank


def _generator_seed(seed: int, count: int) -> int:
    """A 64-bit generator seed that mixes ``seed`` and ``count`` (a splitmix64-style finaliser,
    a bijection of ``seed * odd + count`` mod 2^64): distinct counts of one seed give distinct
    seeds, and seed s at count c+1 is unrelated to seed s+1 at count c."""
    z = (seed * 0x9E3779B97F4A7C15 + count) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def shuffle_permutation(seed: int, count: int, size: int) -> torch.Tensor:
    """The permutation of key batch number ``count`` (``size`` = W*N global images), on the CPU.

    A pure function of Python ints, drawn from a private CPU generator (the global RNGs are
    untouched), so every rank computes the same one without a collective and without the device.
    """
    return torch.randperm(size, generator=torch.Generator().manual_seed(_generator_seed(seed, count)))


class ShufflePlan(NamedTuple):
    """One rank's part of a cross-rank shuffle, all computed on the host from the permutation."""

    send_rows: torch.Tensor     # N: this rank's rows in sending order (grouped by destination rank)
    arrival_slot: torch.Tensor  # N: the shuffled slot of each received row, in arrival order
    unshuffle: torch.Tensor     # W*N: argsort(perm); global image g was encoded at position unshuffle[g]
    send_sizes: list[int]       # W: rows this rank sends to each rank (itself included)
    recv_sizes: list[int]       # W: rows this rank receives from each rank


def shuffle_plan(perm: torch.Tensor, rank: int, world: int) -> ShufflePlan:
    """Index bookkeeping for rank ``rank`` of ``world`` on the CPU permutation ``perm`` (W*N).

    Rank r encodes global images ``perm[r*N:(r+1)*N]`` in that order; global image g is rank
    g // N's image g % N. Everything here is CPU work on ``perm``: the split sizes come out as
    Python ints without touching the device (one ``.tolist()`` of a 2 x W CPU tensor).
    """
    size = perm.numel()
    n = size // world
    unshuffle = torch.empty_like(perm)
    unshuffle[perm] = torch.arange(size)
    # Sending: my image i goes to shuffled position unshuffle[r*N + i], on rank position // N.
    # In ascending position order, rows are grouped by destination rank, each group in the order
    # that rank will encode them.
    destination, send_rows = torch.sort(unshuffle[rank * n:(rank + 1) * n])
    # Receiving: my slot j holds global image perm[r*N + j], owned by rank perm[...] // N. Rows
    # arrive grouped by source rank, each group in the order its sender sorted them (ascending
    # slot), so a stable sort by source rank gives the slot of each arriving row.
    source = perm[rank * n:(rank + 1) * n] // n
    _, arrival_slot = torch.sort(source, stable=True)
    counts = torch.stack([torch.bincount(destination // n, minlength=world),
                          torch.bincount(source, minlength=world)])
    send_sizes, recv_sizes = counts.tolist()  # a CPU tensor: no device involved
    return ShufflePlan(send_rows, arrival_slot, unshuffle, send_sizes, recv_sizes)


class MoCo(nn.Module):
    """MoCo's two encoders, queue and key path; see the module docstring.

    ``shuffle_seed`` (every rank must pass the same; the training script passes ``--seed``) and
    the buffer ``shuffle_count`` (distributed key batches so far) determine the cross-rank
    shuffle BN permutations: see :meth:`_shuffle_across_ranks`.
    """

    def __init__(self, encoder_q: Encoder, dim: int = 128, K: int = 65536, T: float = 0.07,
                 shuffle_bn: bool = True, shuffle_seed: int = 0):
        super().__init__()
        self.K, self.T, self.shuffle_bn, self.shuffle_seed = K, T, shuffle_bn, int(shuffle_seed)
        self.encoder_q = encoder_q
        self.encoder_k = copy.deepcopy(encoder_q)
        for param in self.encoder_k.parameters():
            param.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))  # C x K
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
        # The pointer as a Python int: it only ever advances by the (known) number of keys
        # enqueued, so enqueue() never reads the buffer back from the device. The buffer is
        # still written (on the device) for checkpoints; loading one, or taking rank 0's state,
        # reads it back once (_load_from_state_dict, sync_state_from_rank0).
        self._ptr = 0
        # Distributed key batches shuffled so far, the same pair as _ptr/queue_ptr: the Python
        # int picks the next permutation (no device read), the buffer is written on the device
        # after each shuffle so that checkpoints carry it and a resume continues the sequence.
        self.register_buffer("shuffle_count", torch.zeros(1, dtype=torch.long))
        self._shuffles = 0
        # --compile: torch.compile(encoder_k), kept out of the module tree (see compile_key_encoder).
        self._compiled_encoder_k: nn.Module | None = None

    # ------------------------------------------------------------------ compile
    def compile_key_encoder(self) -> None:
        """Run every key-encoder forward of the key path through ``torch.compile(encoder_k)``.

        The compiled wrapper is stored with ``object.__setattr__``, not registered as a submodule:
        ``state_dict`` keys, ``parameters()`` and ``momentum_update`` stay those of ``encoder_k``
        itself, whose parameters and buffers the compiled code reads and updates in place.
        """
        object.__setattr__(self, "_compiled_encoder_k", torch.compile(self.encoder_k))

    @property
    def _encode_k(self) -> nn.Module:
        """The key encoder as the key path calls it: ``encoder_k``, or its compiled wrapper."""
        return self.encoder_k if self._compiled_encoder_k is None else self._compiled_encoder_k

    # ------------------------------------------------------------------ momentum encoder
    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        """k = m*k + (1-m)*q over all parameters in one fused call (lerp: k + (1-m)(q-k))."""
        k_params = list(self.encoder_k.parameters())
        q_params = [p.detach() for p in self.encoder_q.parameters()]
        torch._foreach_lerp_(k_params, q_params, 1.0 - m)

    @torch.no_grad()
    def sync_state_from_rank0(self) -> None:
        """Make the key encoder, the queue and the shuffle count rank 0's (DDP already did so for
        encoder_q)."""
        for tensor in [*self.encoder_k.state_dict().values(), self.queue, self.queue_ptr,
                       self.shuffle_count]:
            broadcast_(tensor, src=0)
        self._read_counters()  # one host read, at set-up

    def _read_counters(self) -> None:
        """Set the Python ints from ``queue_ptr`` and ``shuffle_count`` (one device->host read)."""
        self._ptr, self._shuffles = torch.cat([self.queue_ptr, self.shuffle_count]).tolist()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """``load_state_dict`` loads ``queue_ptr`` and ``shuffle_count`` here: keep the Python
        ints in step with them.

        A checkpoint written before ``shuffle_count`` existed has no such key: it loads as 0 (the
        key is added to ``state_dict``, the copy that ``load_state_dict`` passes here, so strict
        loading accepts it). Such a run drew its permutations on rank 0 and broadcast them, so
        they cannot be reproduced anyway; from the resume on, the sequence starts at count 0.
        """
        state_dict.setdefault(prefix + "shuffle_count", torch.zeros(1, dtype=torch.long))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._read_counters()  # one host read per checkpoint load

    # ------------------------------------------------------------------ keys
    @torch.no_grad()
    def _shuffle_across_ranks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Give this rank its share of a random permutation of the global key batch.

        The global batch is every rank's N images in rank order (global image g is rank g // N's
        image g % N); every rank must pass the same N. The permutation ``perm`` of the W*N global
        images is :func:`shuffle_permutation` of (``shuffle_seed``, number of distributed key
        batches so far): every rank derives the same one on the CPU, where the MoCo authors' code
        has rank 0 draw it on the device and broadcast it. Deriving it costs no collective, and
        the split sizes that ``all_to_all_single`` needs as Python ints are known on the host
        (:func:`shuffle_plan`) without waiting for the device: nothing here reads a device tensor.
        The index tensors the device needs go over in one non-blocking copy (from pinned memory
        on CUDA). Since ``shuffle_count`` is in checkpoints, a resumed run draws the
        permutations an uninterrupted run would have drawn.

        Rank r encodes global images ``perm[r*N:(r+1)*N]`` in that order. One
        ``all_to_all_single`` moves them: each rank sends each peer exactly the images that peer
        will encode (its own rows picked and grouped by destination rank, so split sizes are
        uneven) and receives exactly its N, nothing else. Per rank: N images out (including those
        it keeps), N in, where gathering the whole batch received W*N. The images carry no
        gradient (key encoder only, under no_grad; the collectives have no autograd).

        Returns the N shuffled images and ``unshuffle`` = argsort(perm) (global image g was
        encoded at shuffled position ``unshuffle[g]``), for :meth:`_unshuffle_and_gather`.
        """
        world, rank, n = get_world_size(), get_rank(), x.shape[0]
        perm = shuffle_permutation(self.shuffle_seed, self._shuffles, world * n)
        plan = shuffle_plan(perm, rank, world)
        self._shuffles += 1
        self.shuffle_count.fill_(self._shuffles)  # a device-side write, for checkpoints
        index = torch.cat([plan.send_rows, plan.arrival_slot, plan.unshuffle])  # one host->device copy
        if x.device.type == "cuda":
            index = index.pin_memory()  # so that the non-blocking copy is asynchronous
        index = index.to(x.device, non_blocking=True)
        send_rows, arrival_slot, unshuffle = index.split([n, n, world * n])
        received = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(received, x.detach()[send_rows].contiguous(),
                               output_split_sizes=plan.recv_sizes, input_split_sizes=plan.send_sizes)
        shuffled = torch.empty_like(received)
        shuffled[arrival_slot] = received
        return shuffled, unshuffle

    @torch.no_grad()
    def _unshuffle_and_gather(self, k: torch.Tensor, unshuffle: torch.Tensor) -> Keys:
        """Bring keys home with one all_gather: this rank's (N x C) and the global batch.

        Each rank sends its N encoded keys (N x C) to every peer and receives all W*N, in
        shuffled order; indexing with ``unshuffle`` puts them in global order (rank 0's first),
        the same on every rank. This rank's own keys are its slice of that. The one gather
        serves both the un-shuffle and the queue (which needs every rank's keys anyway).
        """
        rank, n = get_rank(), k.shape[0]
        k_all = concat_all_gather(k)[unshuffle]  # (W*N) x C: row g is global image g's key
        return Keys(k_all[rank * n:(rank + 1) * n], k_all)

    @torch.no_grad()
    def keys_and_global(self, im_k: torch.Tensor) -> Keys:
        """Unit-length keys of this rank's key images (N x C) and of the global key batch
        ((W*N) x C, rank order, identical on every rank), computed without a graph.

        Distributed with shuffle BN: one all_to_all (images), one all_gather (keys); the
        permutation is derived on every rank, not communicated. Without shuffle BN: one
        all_gather. One process: the batch is shuffled locally (the key encoder's BatchNorm is
        split, see :func:`split_batchnorm`), and the global batch is this rank's. No
        device->host read in any case. The key encoder is ``encoder_k``, or its compiled wrapper
        after :meth:`compile_key_encoder`.
        """
        encode = self._encode_k
        if self.shuffle_bn and is_dist():
            shuffled, unshuffle = self._shuffle_across_ranks(im_k)
            k = F.normalize(encode(shuffled), dim=1)
            return self._unshuffle_and_gather(k, unshuffle)
        if self.shuffle_bn:
            perm = torch.randperm(im_k.shape[0], device=im_k.device)  # one process: with split BN
            k = F.normalize(encode(im_k[perm]), dim=1)
            k = k[torch.argsort(perm)]
        else:
            k = F.normalize(encode(im_k), dim=1)
        return Keys(k, concat_all_gather(k) if is_dist() else k)

    # ------------------------------------------------------------------ queue
    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, *, gathered: bool = False) -> None:
        """Write every rank's keys into the ring buffer (detached; identical on every rank).

        ``gathered=False``: ``keys`` are this rank's (n x C) and are all_gathered here, rank by
        rank. ``gathered=True``: ``keys`` are already every rank's, the same tensor on every rank
        (:meth:`keys_and_global`'s ``all_ranks``, or several of them concatenated): no
        collective. No device->host read: the pointer is tracked as a Python int.
        """
        if not gathered:
            keys = concat_all_gather(keys)  # (W*n) x C, identical on every rank
        n, ptr = keys.shape[0], self._ptr
        if n > self.K:
            raise ValueError(f"enqueue: {n} keys do not fit a queue of K={self.K}")
        keys_t = keys.detach().T.to(self.queue.dtype)  # C x n
        first = min(n, self.K - ptr)  # the slots up to the end, then the rest from the start
        self.queue[:, ptr:ptr + first] = keys_t[:, :first]
        if first < n:
            self.queue[:, :n - first] = keys_t[:, first:]
        self._ptr = (ptr + n) % self.K
        self.queue_ptr.fill_(self._ptr)  # a device-side write, for checkpoints

    # ------------------------------------------------------------------ queries and negatives
    def queries(self, im: torch.Tensor, query_encoder: nn.Module | None = None) -> torch.Tensor:
        """Unit-length queries (N x C), with a graph: ``query_encoder`` is the DDP wrapper of
        ``encoder_q`` when distributed (so that the backward all-reduces its gradients), else
        ``encoder_q``. Each call is one forward: BatchNorm normalises over ``im`` alone."""
        encode = self.encoder_q if query_encoder is None else query_encoder
        return F.normalize(encode(im), dim=1)

    @torch.no_grad()
    def negatives(self) -> torch.Tensor:
        """The queue (C x K) as a detached copy: :meth:`enqueue` later writes the buffer in place,
        which must never touch a tensor that a graph saved for its backward."""
        return self.queue.clone().detach()

    # ------------------------------------------------------------------ the two losses' inputs
    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor, query_encoder: nn.Module | None = None,
                global_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Contrastive logits (N x (1+K), positive first) and keys to enqueue, without a graph:
        this rank's (N x C), or with ``global_keys=True`` every rank's ((W*N) x C, rank order,
        identical on every rank) for ``enqueue(..., gathered=True)``, which then gathers nothing.

        ``query_encoder``: see :meth:`queries`. The caller enqueues the keys once the optimizer
        step is applied.
        """
        keys = self.keys_and_global(im_k)  # no grad
        logits = info_nce(self.queries(im_q, query_encoder), keys.local, self.negatives(), self.T)
        return logits, keys.all_ranks if global_keys else keys.local

    def symmetric_forward(self, im_1: torch.Tensor, im_2: torch.Tensor, query_encoder: nn.Module | None = None,
                          global_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both directions, as the MoCo authors' CIFAR-10 demo (``--symmetric``): logits of
        (q1, k2) and of (q2, k1) against the same negatives (the queue before this step's
        keys), for :func:`symmetric_contrastive_loss`, and the keys of both crops to enqueue,
        crop 1's first (the demo's ``torch.cat([k1, k2])``): with ``global_keys=True`` every
        rank's crop-1 keys in rank order, then every rank's crop-2 keys ((2*W*N) x C, identical on
        every rank); else this rank's [k1; k2] (2N x C).

        Each crop is one forward of the query encoder (BatchNorm statistics per crop, as in the
        demo) and one key pass with its own shuffle, crop 2's first (the demo computes loss_12,
        whose key pass encodes crop 2, before loss_21).
        """
        k2 = self.keys_and_global(im_2)
        k1 = self.keys_and_global(im_1)
        negatives = self.negatives()
        logits_12 = info_nce(self.queries(im_1, query_encoder), k2.local, negatives, self.T)
        logits_21 = info_nce(self.queries(im_2, query_encoder), k1.local, negatives, self.T)
        keys = (k1.all_ranks, k2.all_ranks) if global_keys else (k1.local, k2.local)
        return logits_12, logits_21, torch.cat(keys)


# ----------------------------------------------------------------------------- losses
def info_nce(q: torch.Tensor, k: torch.Tensor, negatives: torch.Tensor, T: float) -> torch.Tensor:
    """InfoNCE logits (N x (1+K)) / T: column 0 is each query's positive q_i . k_i, the others
    its similarities to the negatives (C x K). ``q`` (N x C) carries the graph; ``k`` and
    ``negatives`` carry none."""
    l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)   # N x 1
    l_neg = torch.einsum("nc,ck->nk", q, negatives)       # N x K
    return torch.cat([l_pos, l_neg], dim=1) / T


def contrastive_loss(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy against the positive (index 0), and how often the positive wins (0..1)."""
    labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    loss = F.cross_entropy(logits.float(), labels)
    accuracy = (logits.argmax(dim=1) == 0).float().mean()
    return loss, accuracy.detach()


def symmetric_contrastive_loss(logits_12: torch.Tensor,
                               logits_21: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """loss(q1, k2) + loss(q2, k1), a sum as in the MoCo authors' CIFAR-10 demo (not a mean), and
    the positive's win rate averaged over both directions."""
    loss_12, acc_12 = contrastive_loss(logits_12)
    loss_21, acc_21 = contrastive_loss(logits_21)
    return loss_12 + loss_21, (acc_12 + acc_21) / 2
