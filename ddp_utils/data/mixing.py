"""MixUp and CutMix of a training micro-batch, on the training device, replayable from integers.

The mixing itself is torchvision's ``transforms.v2.MixUp`` / ``CutMix`` (one of the two chosen by
``RandomChoice`` when both are on): the implementation torchvision's reference recipe trains with,
kept and tested upstream, so "MixUp" here means exactly what it means there (lambda ~ Beta(alpha,
alpha); each image paired with its predecessor in the batch, the first with the last; CutMix's
pasted box area sets the effective lambda; one-hot targets mixed by the same lambda). What this
module adds is where its random numbers come from.

Every random draw of those transforms (the choice, lambda, the box) is made on the CPU's default
generator. :class:`BatchMixer` seeds that generator, inside ``torch.random.fork_rng``, from
(``seed``, the epoch, the micro-batch's index in the epoch, the rank) before each call, and puts
the caller's RNG back afterwards. So a micro-batch is mixed the same way whatever ran before it:
a run resumed mid-epoch mixes as the uninterrupted one did, a window that is given up and
replayed mixes again as before, and the global RNG's position (dropout, anything else) is not
moved by mixing. The rank is part of the key: ranks draw their own lambdas, as torchvision's
per-GPU collate does, and images are paired only within one rank's micro-batch.
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
