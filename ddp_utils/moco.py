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

BatchNorm: a key encoder that normalises over the same samples as the query encoder lets the
model "cheat" (the positive pair shares batch statistics). Shuffle BN blocks that: across ranks,
key images are shuffled between ranks before the key encoder and un-shuffled after; on one
process, BatchNorm is split into ``bn_splits`` groups and the key batch is shuffled locally.
The key encoder's BatchNorm running statistics are its own (from its own forward passes in
train mode), not an EMA of the query encoder's buffers, and they are per rank (no DDP broadcasts
them; checkpoints keep rank 0's). Training never reads them: the key encoder always normalises
with batch statistics, as in the MoCo authors' code.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import broadcast_, concat_all_gather
from .dist import get_rank, get_world_size, is_dist


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


class MoCo(nn.Module):
    def __init__(self, encoder_q: Encoder, dim: int = 128, K: int = 65536, T: float = 0.07,
                 shuffle_bn: bool = True):
        super().__init__()
        self.K, self.T, self.shuffle_bn = K, T, shuffle_bn
        self.encoder_q = encoder_q
        self.encoder_k = copy.deepcopy(encoder_q)
        for param in self.encoder_k.parameters():
            param.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))  # C x K
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    # ------------------------------------------------------------------ momentum encoder
    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        """k = m*k + (1-m)*q over all parameters in one fused call (lerp: k + (1-m)(q-k))."""
        k_params = list(self.encoder_k.parameters())
        q_params = [p.detach() for p in self.encoder_q.parameters()]
        torch._foreach_lerp_(k_params, q_params, 1.0 - m)

    @torch.no_grad()
    def sync_state_from_rank0(self) -> None:
        """Make the key encoder and the queue rank 0's (DDP already did so for encoder_q)."""
        for tensor in [*self.encoder_k.state_dict().values(), self.queue, self.queue_ptr]:
            broadcast_(tensor, src=0)

    # ------------------------------------------------------------------ keys
    @torch.no_grad()
    def _shuffle_across_ranks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Give this rank a random slice of the global key batch; return it and the inverse map."""
        x_all = concat_all_gather(x)  # (W*N) x ...; a plain all_gather: no gradient flows back
        perm = torch.randperm(x_all.shape[0], device=x.device) if get_rank() == 0 \
            else torch.empty(x_all.shape[0], dtype=torch.long, device=x.device)
        broadcast_(perm, src=0)  # every rank must use rank 0's permutation
        mine = perm.view(get_world_size(), -1)[get_rank()]
        return x_all[mine], torch.argsort(perm)

    @torch.no_grad()
    def _unshuffle_across_ranks(self, k: torch.Tensor, unshuffle: torch.Tensor) -> torch.Tensor:
        k_all = concat_all_gather(k)  # (W*N) x C, in shuffled order
        return k_all[unshuffle.view(get_world_size(), -1)[get_rank()]]

    @torch.no_grad()
    def keys(self, im_k: torch.Tensor) -> torch.Tensor:
        """Unit-length keys of this rank's key images (N x C), computed without a graph."""
        if not self.shuffle_bn:
            return F.normalize(self.encoder_k(im_k), dim=1)
        if is_dist():
            shuffled, unshuffle = self._shuffle_across_ranks(im_k)
            k = F.normalize(self.encoder_k(shuffled), dim=1)
            return self._unshuffle_across_ranks(k, unshuffle)
        perm = torch.randperm(im_k.shape[0], device=im_k.device)  # one process: with split BN
        k = F.normalize(self.encoder_k(im_k[perm]), dim=1)
        return k[torch.argsort(perm)]

    # ------------------------------------------------------------------ queue
    @torch.no_grad()
    def enqueue(self, k: torch.Tensor) -> None:
        """Write every rank's keys (gathered; detached by construction) into the ring buffer."""
        keys = concat_all_gather(k)  # (W*N) x C, identical on every rank
        n = keys.shape[0]
        ptr = int(self.queue_ptr)
        slots = (ptr + torch.arange(n, device=keys.device)) % self.K  # wraps around the end
        self.queue[:, slots] = keys.T.to(self.queue.dtype)
        self.queue_ptr[0] = (ptr + n) % self.K

    # ------------------------------------------------------------------ loss
    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor,
                query_encoder: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Contrastive logits (N x (1+K), positive first) and this batch's keys (N x C).

        ``query_encoder`` is the DDP wrapper of ``encoder_q`` when distributed, so that the
        backward all-reduces its gradients. The caller enqueues the keys once the optimizer step is applied.
        """
        encode = self.encoder_q if query_encoder is None else query_encoder
        q = F.normalize(encode(im_q), dim=1)                              # N x C
        k = self.keys(im_k)                                              # N x C, no grad
        l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)            # N x 1
        # The queue is read through a detached copy: enqueue() later writes the buffer in place,
        # which must never touch a tensor this graph saved for its backward.
        l_neg = torch.einsum("nc,ck->nk", q, self.queue.clone().detach())  # N x K
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T              # N x (1+K)
        return logits, k


def contrastive_loss(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy against the positive (index 0), and how often the positive wins (0..1)."""
    labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    loss = F.cross_entropy(logits.float(), labels)
    accuracy = (logits.argmax(dim=1) == 0).float().mean()
    return loss, accuracy.detach()
