"""MixUp and CutMix of a training micro-batch, on the training device: torchvision's own
``transforms.v2.MixUp`` / ``CutMix`` (``RandomChoice`` of the two when both are on), every draw made
by :class:`BatchMixer` from a generator seeded by (seed, epoch, micro-batch, rank) inside
``fork_rng``. So a micro-batch mixes the same whatever ran before (a resume, a replayed window) and
no other random stream moves (docs/recipe.md, "MixUp and CutMix").
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import hashing

MIX_STREAM = 0x4D49_5855  # "MIXU": keeps these seeds apart from the other users of hashing.seed


def mix_seed(seed: int, epoch: int, index: int, rank: int) -> int:
    """The CPU generator's seed for the mixing of micro-batch ``index`` (0-based, counted from the
    epoch's start on this rank) of ``epoch`` on ``rank``: the contract a replay relies on."""
    return hashing.seed(seed, MIX_STREAM, epoch, index, rank)


class BatchMixer:
    """MixUp (``mixup_alpha`` > 0) and/or CutMix (``cutmix_alpha`` > 0) of a micro-batch; with
    both, each micro-batch gets one of them, probability 0.5 each. ``mixer(images, targets, epoch,
    index)``: images (N x C x H x W, any device) and integer class targets (N) in, mixed images and
    soft targets (N x ``num_classes``, float32, rows summing to 1) out; the inputs are not changed.
    With both alphas 0 it hands the batch back as it came (integer targets)."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, num_classes: int, seed: int, rank: int):
        self.transform = None
        if mixup_alpha > 0 or cutmix_alpha > 0:
            # here: importing torchvision costs a process about 2 s (torch._dynamo), and most runs do not mix
            from torchvision.transforms import v2

            chosen = [v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []
            chosen += [v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else []
            self.transform = v2.RandomChoice(chosen) if len(chosen) > 1 else chosen[0]
        self.seed, self.rank = seed, rank

    @property
    def enabled(self) -> bool:
        return self.transform is not None

    def __call__(self, images: Tensor, targets: Tensor, epoch: int, index: int) -> tuple[Tensor, Tensor]:
        if self.transform is None:
            return images, targets
        with torch.random.fork_rng(devices=[]):  # the CPU generator alone: the transforms draw nothing elsewhere
            torch.default_generator.manual_seed(mix_seed(self.seed, epoch, index, self.rank))
            return self.transform(images, targets)
