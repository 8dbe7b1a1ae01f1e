"""Gradient accumulation under DDP: the window plan, ``no_sync``, and the pieces of the optimizer
step that the training scripts write out (:func:`fp16_overflow`, :func:`set_lr`). Each micro-batch
runs backward at once on its loss divided by its window's real length; only a window's last
micro-step all-reduces. Why, and the loop itself: docs/accumulation.md. Mixed precision is in
``runtime.precision``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn


@dataclass(frozen=True)
class MicroStep:
    index: int        # position inside its window, 0-based
    window_size: int  # micro-batches in this window (A, or fewer for an epoch's last window)

    @property
    def is_last(self) -> bool:
        """The window's last micro-step: its backward all-reduces, then the optimizer steps."""
        return self.index == self.window_size - 1


def plan_windows(num_micro_batches: int, accum_steps: int) -> list[MicroStep]:
    """The micro-step plan for an epoch: full windows of ``accum_steps``, then the remainder."""
    plan = []
    for start in range(0, num_micro_batches, accum_steps):
        size = min(accum_steps, num_micro_batches - start)
        plan += [MicroStep(i, size) for i in range(size)]
    return plan


def no_sync(network: nn.Module, enabled: bool) -> ContextManager:
    """DDP's ``network.no_sync()`` when ``enabled``; a bare module has no all-reduce to skip."""
    if enabled and hasattr(network, "no_sync"):
        return network.no_sync()
    return contextlib.nullcontext()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The LR of the coming step, for every parameter group (the schedule is a function of the
    step: nothing to save, exact on resume)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def stepped_parameters(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters that have a gradient this step, in its groups' order (what
    clipping measures and fp16's overflow test reads)."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def fp16_overflow(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                  grad_norm: torch.Tensor | None) -> torch.Tensor | None:
    """fp16 (``scaler`` enabled): whether the unscaled gradients hold an Inf or NaN, from their
    total norm (``grad_norm`` when clipping computed it, else computed here), left on the device
    so that the ranks' agreement reads it with everything else in its one host read. None
    without fp16."""
    if not scaler.is_enabled():
        return None
    if grad_norm is None:
        grad_norm = nn.utils.get_total_norm([p.grad for p in stepped_parameters(optimizer)])
    return ~torch.isfinite(grad_norm)
