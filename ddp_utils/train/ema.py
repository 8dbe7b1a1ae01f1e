"""An exponential moving average of the weights (train_classifier.py's ``--model-ema``) with
torchvision's semantics (``utils.ExponentialMovingAverage``: an ``AveragedModel`` over parameters and
buffers, its decay adjustment and warm-up reset), counted in optimizer steps, the decay adjusted by
the global batch; after each update its buffers are rank 0's, so it is the same on every rank, bit
for bit. The rules and how they map to torchvision's: docs/recipe.md, "The EMA of the weights".
"""
from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ..runtime.collectives import broadcast_coalesced_


def ema_decay(model_ema_decay: float, global_batch: int, every: int, epochs: int) -> float:
    """The decay of each update, torchvision's adjustment of ``--model-ema-decay`` (the same
    floating-point operations, so the same bits): ``global_batch`` is the images of one
    optimizer step over all ranks (torchvision's ``world_size * batch_size``)."""
    adjust = global_batch * every / epochs
    alpha = 1.0 - model_ema_decay
    alpha = min(1.0, alpha * adjust)
    return 1.0 - alpha


class WeightsEMA(AveragedModel):
    """The EMA of ``model``'s parameters and buffers (a copy of the model, on its device, that
    no gradient reaches). ``every``: optimizer steps of an epoch between updates; the LR's
    warm-up (``warmup_epochs``, ``warmup_steps``) keeps it copying the weights."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1, warmup_epochs: int = 0,
                 warmup_steps: int = 0):
        def ema_avg(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor) -> torch.Tensor:
            return decay * averaged + (1 - decay) * current  # torchvision's avg_fn (AveragedModel's own loop uses it)

        super().__init__(model, avg_fn=ema_avg, use_buffers=True)  # n_averaged stays on the CPU: no device read
        self.module.requires_grad_(False)
        self.decay, self.every = decay, every
        self.warmup_epochs, self.warmup_steps = warmup_epochs, warmup_steps

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """AveragedModel's update with ``avg_fn`` (copy while ``n_averaged`` is 0, then the
        average), the same operations on the same tensors, as a few multi-tensor kernels and with
        no read of the device (AveragedModel moves ``n_averaged`` to the device once per tensor)."""
        mine = [*self.module.parameters(), *self.module.buffers()]
        theirs = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if int(self.n_averaged) == 0:
            torch._foreach_copy_(mine, theirs)
        else:
            floats = [i for i, t in enumerate(mine) if t.is_floating_point()]
            averaged, current = [mine[i] for i in floats], [theirs[i] for i in floats]
            torch._foreach_mul_(averaged, self.decay)
            torch._foreach_add_(averaged, torch._foreach_mul(current, 1 - self.decay))
            for ema, now in zip(mine, theirs):
                if not ema.is_floating_point():  # BatchNorm's num_batches_tracked, as avg_fn leaves it
                    ema.copy_(self.decay * ema + (1 - self.decay) * now)
        self.n_averaged += 1

    def after_step(self, model: nn.Module, step: int, epoch: int, step_in_epoch: int, distributed: bool) -> bool:
        """After optimizer step ``step`` (0-based), the ``step_in_epoch``-th of 0-based ``epoch``:
        update from ``model`` (the bare module) if it is due; returns whether it was."""
        if step_in_epoch % self.every:
            return False
        self.update_parameters(model)
        if epoch < self.warmup_epochs or step < self.warmup_steps:
            self.n_averaged.fill_(0)  # the LR warms up: the next update copies the weights again
        if distributed:
            broadcast_coalesced_(list(self.module.buffers()))  # rank 0's statistics on every rank
        return True
