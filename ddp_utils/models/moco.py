"""MoCo: Momentum Contrast (He et al. 2020, v1; Chen et al. 2020, "Improved Baselines", v2).

* ``encoder_q``: backbone + projection head (an :class:`Encoder`, which takes one crop or
  several in one call), trained by SGD; only it goes into DDP, so DDP never broadcasts the queue
  or the key encoder. A micro-step calls it once, on all its query crops (:meth:`MoCo.queries`).
* ``encoder_k``: a copy without gradients, never in DDP or the optimizer, moved only by
  :meth:`MoCo.momentum_update`, once per optimizer step on every rank.
* ``queue`` (C x K) and ``queue_ptr``: buffers (so in checkpoints) that only ever receive the
  same all_gathered, detached keys on every rank: identical everywhere.

The key encoder's BatchNorm statistics are its own, per rank, as in the authors' code. The
losses are plain functions of the logits. Nothing here reads the device during training.
"""
from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..runtime.collectives import broadcast_, concat_all_gather
from ..runtime.dist import get_rank, get_world_size, is_dist
from .shuffle_bn import gather_unshuffled, plan_shuffle, shuffle_permutation, shuffle_to_ranks


class Encoder(nn.Module):
    """A backbone (a classifier with ``fc`` removed) followed by a projection head."""

    def __init__(self, backbone: nn.Module, feature_dim: int, out_dim: int, mlp: bool):
        super().__init__()
        self.backbone = backbone
        if mlp:  # v2: a 2-layer MLP head
            self.head = nn.Sequential(nn.Linear(feature_dim, feature_dim), nn.ReLU(inplace=True),
                                      nn.Linear(feature_dim, out_dim))
        else:    # v1: one linear layer
            self.head = nn.Linear(feature_dim, out_dim)

    def forward(self, *crops: Tensor) -> Tensor | tuple[Tensor, ...]:
        """The projection (N x out_dim) of one crop; of several crops, a tuple of them in order.
        Each crop is its own batch (its own BatchNorm statistics) however many come in one call."""
        outputs = tuple(self.head(self.backbone(x)) for x in crops)
        return outputs if len(outputs) > 1 else outputs[0]


class MoCo(nn.Module):
    """``encoder_q``: one crop (N x 3 x H x W) to N x ``dim``; for :meth:`symmetric_forward` it
    also takes two crops in one call and returns both outputs, as :class:`Encoder` does.
    ``dim``: key size C; ``K``: queue length; ``T``: softmax temperature; ``shuffle_bn``: see
    ``shuffle_bn``; ``shuffle_seed``: the same on every rank (the scripts pass ``--seed``)."""

    def __init__(self, encoder_q: nn.Module, dim: int = 128, K: int = 65536, T: float = 0.07,
                 shuffle_bn: bool = True, shuffle_seed: int = 0):
        super().__init__()
        self.K, self.T, self.shuffle_bn, self.shuffle_seed = K, T, shuffle_bn, int(shuffle_seed)
        self.encoder_q = encoder_q
        self.encoder_k = copy.deepcopy(encoder_q)
        for param in self.encoder_k.parameters():
            param.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))  # C x K
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
        # key batches shuffled across ranks so far: picks the next permutation, also after a resume
        self.register_buffer("shuffle_count", torch.zeros(1, dtype=torch.long))
        # both counters also as Python ints, so that a step never reads them from the device
        self._ptr = self._shuffles = 0
        # --compile: torch.compile(encoder_k), kept out of the module tree (no new state-dict keys)
        self.compiled_key_encoder: nn.Module | None = None

    @property
    def queue_position(self) -> int:
        """Where the next key goes in the queue: ``queue_ptr``'s value, kept as a Python int."""
        return self._ptr

    @property
    def key_batches_shuffled(self) -> int:
        """Key batches shuffled across ranks so far: ``shuffle_count``'s value, as a Python int."""
        return self._shuffles

    def compile_key_encoder(self) -> None:
        """Run the key encoder through ``torch.compile``; its parameters stay encoder_k's own."""
        object.__setattr__(self, "compiled_key_encoder", torch.compile(self.encoder_k))

    # ForwardState, for the window's undo (train.run.WindowUndo, registered by train_moco.setup): a
    # given-up window puts the shuffle count back, so later shuffles are those of a run that never met it.
    def forward_state(self) -> int:
        """What a training forward advances besides BatchNorm statistics: the number of key
        batches shuffled so far."""
        return self._shuffles

    def restore_forward_state(self, shuffles: int) -> None:
        self._shuffles = shuffles
        self.shuffle_count.fill_(shuffles)

    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        """k = m*k + (1-m)*q over all parameters in one fused call (lerp: k + (1-m)(q-k))."""
        k_params = list(self.encoder_k.parameters())
        q_params = [p.detach() for p in self.encoder_q.parameters()]
        torch._foreach_lerp_(k_params, q_params, 1.0 - m)

    @torch.no_grad()
    def sync_state_from_rank0(self) -> None:
        """Rank 0's key encoder, queue and counters on every rank (DDP does encoder_q)."""
        for tensor in [*self.encoder_k.state_dict().values(), self.queue, self.queue_ptr, self.shuffle_count]:
            broadcast_(tensor, src=0)
        self._read_counters()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._read_counters()  # the loaded buffers' values, once

    def _read_counters(self) -> None:
        self._ptr, self._shuffles = torch.cat([self.queue_ptr, self.shuffle_count]).tolist()

    @torch.no_grad()
    def keys(self, im_k: Tensor) -> Tensor:
        """Unit keys of every rank's key images, (W*N) x C in rank order, identical on every
        rank, without a graph; this rank's are rows ``rank*N .. (rank+1)*N``."""
        encode = self.encoder_k if self.compiled_key_encoder is None else self.compiled_key_encoder
        if self.shuffle_bn and is_dist():
            world = get_world_size()
            perm = shuffle_permutation(self.shuffle_seed, self._shuffles, world * len(im_k))  # W*N, CPU
            self._shuffles += 1
            self.shuffle_count.fill_(self._shuffles)  # a write on the device, for checkpoints
            plan = plan_shuffle(perm, get_rank(), world, im_k.device)
            k = F.normalize(encode(shuffle_to_ranks(im_k, plan)), dim=1)  # N x C, shuffled order
            return gather_unshuffled(k, plan)  # (W*N) x C, rank order
        if self.shuffle_bn:  # one process: split BatchNorm over a locally shuffled batch
            perm = torch.randperm(len(im_k), device=im_k.device)
            k = F.normalize(encode(im_k[perm]), dim=1)[torch.argsort(perm)]  # N x C
        else:
            k = F.normalize(encode(im_k), dim=1)  # N x C
        return concat_all_gather(k)  # (W*N) x C

    @torch.no_grad()
    def enqueue(self, keys: Tensor) -> None:
        """Write ``keys`` (n x C, already every rank's: the same on every rank) into the ring."""
        n, ptr = keys.shape[0], self._ptr
        if n > self.K:
            raise ValueError(f"enqueue: {n} keys do not fit a queue of K={self.K}")
        keys_t = keys.detach().T.to(self.queue.dtype)  # C x n
        first = min(n, self.K - ptr)  # the slots up to the end, then the rest from the start
        self.queue[:, ptr:ptr + first] = keys_t[:, :first]
        if first < n:
            self.queue[:, :n - first] = keys_t[:, first:]
        self._ptr = (ptr + n) % self.K
        self.queue_ptr.fill_(self._ptr)  # a write on the device, for checkpoints

    @torch.no_grad()
    def negatives(self) -> Tensor:
        """The queue (C x K) as a detached copy: :meth:`enqueue` later writes the buffer in place,
        which must never touch a tensor that a graph saved for its backward."""
        return self.queue.clone()

    def queries(self, *crops: Tensor, query_encoder: nn.Module | None = None) -> tuple[Tensor, ...]:
        """Unit queries (N x C) of each crop, with a graph, from one call of the query encoder.
        ``query_encoder``: the DDP wrapper of encoder_q when distributed, so that backward
        all-reduces its gradients.

        One call is one DDP forward per micro-step whatever the number of crops. DDP may rewrite
        the BatchNorm buffers in place before each forward (torch 2.11 broadcasts rank 0's at
        every one); a second forward before backward would change running statistics that the
        first crop's BatchNorm saved for it, and backward would refuse ("modified by an inplace
        operation")."""
        out = (self.encoder_q if query_encoder is None else query_encoder)(*crops)
        return tuple(F.normalize(q, dim=1) for q in (out if len(crops) > 1 else (out,)))

    def forward(self, im_q: Tensor, im_k: Tensor, query_encoder: nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """Logits N x (1+K) of queries ``im_q`` against the keys of ``im_k`` (positive first),
        and every rank's keys ((W*N) x C) to enqueue once the optimizer step is applied."""
        keys = self.keys(im_k)                                   # (W*N) x C, no graph
        q, = self.queries(im_q, query_encoder=query_encoder)     # N x C
        return info_nce(q, _own_rows(keys, len(q)), self.negatives(), self.T), keys

    def symmetric_forward(self, im_1: Tensor, im_2: Tensor,
                          query_encoder: nn.Module | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Both directions, as the authors' CIFAR-10 demo: logits of (q1, k2) and of (q2, k1)
        against the same negatives, and both crops' keys to enqueue, crop 1's first
        ((2*W*N) x C). Each key pass has its own shuffle, crop 2's first (the demo's order)."""
        k2, k1 = self.keys(im_2), self.keys(im_1)                # (W*N) x C each
        negatives = self.negatives()                             # C x K
        q1, q2 = self.queries(im_1, im_2, query_encoder=query_encoder)  # N x C each, one forward
        logits_12 = info_nce(q1, _own_rows(k2, len(q1)), negatives, self.T)
        logits_21 = info_nce(q2, _own_rows(k1, len(q2)), negatives, self.T)
        return logits_12, logits_21, torch.cat([k1, k2])


def _own_rows(keys: Tensor, n: int) -> Tensor:
    """This rank's n keys of a global key batch in rank order."""
    return keys.narrow(0, get_rank() * n, n)


# ----------------------------------------------------------------------------- losses
def info_nce(q: Tensor, k: Tensor, negatives: Tensor, T: float) -> Tensor:
    """InfoNCE logits (N x (1+K)) / T in fp32, autocast or not (a bf16 matmul would round the
    similarities before the division by a small T): column 0 is each query's positive q_i . k_i,
    the others its similarities to the negatives (C x K). Only ``q`` (N x C) carries a graph."""
    with torch.autocast(q.device.type, enabled=False):
        q, k, negatives = q.float(), k.float(), negatives.float()
        l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)   # N x 1
        l_neg = torch.einsum("nc,ck->nk", q, negatives)        # N x K
        return torch.cat([l_pos, l_neg], dim=1) / T


def contrastive_loss(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Cross-entropy against the positive (index 0), and how often the positive wins (0..1)."""
    labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    loss = F.cross_entropy(logits.float(), labels)
    accuracy = (logits.argmax(dim=1) == 0).float().mean()
    return loss, accuracy.detach()


def symmetric_contrastive_loss(logits_12: Tensor, logits_21: Tensor) -> tuple[Tensor, Tensor]:
    """loss(q1, k2) + loss(q2, k1), summed as in the authors' CIFAR-10 demo, and the positive's
    win rate over both directions."""
    loss_12, acc_12 = contrastive_loss(logits_12)
    loss_21, acc_21 = contrastive_loss(logits_21)
    return loss_12 + loss_21, (acc_12 + acc_21) / 2


# ----------------------------------------------------------------------------- a micro-step's loss
class ContrastiveStep(NamedTuple):
    """What one micro-step of MoCo training computes, whichever the loss."""

    loss: Tensor      # this micro-batch's loss (0-dim), with a graph to encoder_q only
    accuracy: Tensor  # how often the positive wins (0-dim, 0..1), no graph
    keys: Tensor      # every rank's keys, to enqueue once the optimizer step is applied, no graph


def asymmetric_step(moco: MoCo, im_q: Tensor, im_k: Tensor, query_encoder: nn.Module | None = None) -> ContrastiveStep:
    """MoCo's loss: the queries of ``im_q`` against the keys of ``im_k`` (and the queue)."""
    logits, keys = moco(im_q, im_k, query_encoder)  # logits: N x (1+K); keys: (W*N) x C
    loss, accuracy = contrastive_loss(logits)
    return ContrastiveStep(loss, accuracy, keys)


def symmetric_step(moco: MoCo, im_1: Tensor, im_2: Tensor, query_encoder: nn.Module | None = None) -> ContrastiveStep:
    """The authors' CIFAR-10 demo's loss(q1, k2) + loss(q2, k1); both crops' keys to enqueue."""
    logits_12, logits_21, keys = moco.symmetric_forward(im_1, im_2, query_encoder)  # keys: (2*W*N) x C
    loss, accuracy = symmetric_contrastive_loss(logits_12, logits_21)
    return ContrastiveStep(loss, accuracy, keys)


def contrastive_step(symmetric: bool) -> Callable[..., ContrastiveStep]:
    """The micro-step of ``--symmetric`` or of MoCo's own loss: chosen once, before the loop."""
    return symmetric_step if symmetric else asymmetric_step
