"""Gradient accumulation under DDP: the window plan, ``no_sync``, and the optimizer step.

A window of ``A`` micro-batches makes one optimizer step. Each micro-batch runs forward and
backward at once on its loss divided by the window's real length (an epoch's last window may be
shorter), so no graph outlives its micro-step and no backward sees weights an optimizer step
changed. Micro-steps 1..n-1 run under DDP's ``no_sync()``; the n-th all-reduces the summed
gradients, so they cross the network once per optimizer step. The training scripts show this
loop; :func:`optimizer_step` ends each window.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from ..runtime.stopping import StepVerdict
from .state import RunState

# The ranks' agreement at a window's end: (this rank's non-finite-loss flag, its fp16 overflow
# flag or None) -> what all ranks agreed (runtime.stopping.StepGuard, with the run's own inputs).
Agreement = Callable[[torch.Tensor, "torch.Tensor | None"], StepVerdict]


@dataclass(frozen=True)
class MicroStep:
    index: int        # position inside its window, 0-based
    window_size: int  # micro-batches in this window (A, or fewer for an epoch's last window)

    @property
    def is_last(self) -> bool:
        """The window's last micro-step: its backward all-reduces, then the optimizer steps."""
        return self.index == self.window_size - 1


@dataclass(frozen=True)
class StepResult:
    applied: bool               # the weights moved: not skipped for a NaN/Inf loss or an fp16 overflow
    verdict: StepVerdict        # what the ranks agreed on
    grad_norm: torch.Tensor | None = None  # total L2 norm before clipping (fp16 or --clip-grad), on the device


class WindowStart:
    """What a window changes besides the gradients, kept as it begins, so that a window that must
    be given up (an image file in it could not be decoded) can be undone exactly: the BatchNorm
    statistics its forwards update, the RNG streams, and the counters of modules that keep one
    (``forward_state()`` / ``restore_forward_state(state)``: MoCo's shuffle count). Keeping them
    is one foreach copy of the statistics per window (kilobytes) and no device read."""

    _NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

    def __init__(self, model: nn.Module, device: torch.device):
        modules = list(model.modules())
        self.statistics = [b for m in modules if isinstance(m, self._NORMS) for b in m.buffers(recurse=False)]
        self.kept = [torch.empty_like(b) for b in self.statistics]
        self.counted = [m for m in modules if hasattr(m, "forward_state")]
        self.device = device
        self.rng: tuple = ()
        self.counts: list = []

    def save(self) -> None:
        if self.statistics:
            torch._foreach_copy_(self.kept, self.statistics)
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.rng = (torch.get_rng_state(), cuda)
        self.counts = [m.forward_state() for m in self.counted]

    def restore(self) -> None:
        if self.statistics:
            torch._foreach_copy_(self.statistics, self.kept)
        cpu, cuda = self.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        for module, count in zip(self.counted, self.counts):
            module.restore_forward_state(count)


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


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, window_loss: torch.Tensor, *,
                   agree: Agreement, lr_at: Callable[[int], float], state: RunState, clip_grad: float = 0.0,
                   zero_in_place: bool = False) -> StepResult:
    """End an accumulation window on every rank alike: unscale (fp16) and clip the gradients to
    ``clip_grad`` (0: off), ``agree`` across ranks (a NaN/Inf ``window_loss`` anywhere, a stop
    signal, an fp16 overflow, a file that could not be decoded), set the LR of step
    ``state.step`` (``lr_at``), step the optimizer unless the step must be skipped, update the
    scaler, zero the gradients (in place with ``zero_in_place``: under DDP they are views into its
    buckets) and count the step in ``state``; a window that met an undecodable file only zeroes the
    gradients (the caller stops the run). The agreement is the step's one host read."""
    grad_norm, overflow = _unscale_and_clip(optimizer, scaler, clip_grad)
    verdict = agree(~torch.isfinite(window_loss.detach()), overflow)
    if verdict.unreadable_ranks:  # the window met a file that cannot be decoded: it is undone, not a step
        optimizer.zero_grad(set_to_none=not zero_in_place)
        return StepResult(False, verdict, grad_norm)
    applied = not verdict.nonfinite_ranks and not verdict.overflow
    lr = lr_at(state.step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if applied:
        optimizer.step()  # on the unscaled gradients: GradScaler.step would read the overflow again
    scaler.update()  # fp16: lowers the scale after an overflow, raises it after enough good steps
    # Zeroed in place, DDP's bucket views stay so; set to None, autograd would allocate new ones
    # every step and DDP copy them into its buckets. One process frees them.
    optimizer.zero_grad(set_to_none=not zero_in_place)
    state.step += 1
    return StepResult(applied, verdict, grad_norm)


def _unscale_and_clip(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                      clip_grad: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp16: unscale; --clip-grad: clip. The pre-clip total norm and fp16's overflow flag, both
    left on the device."""
    if not scaler.is_enabled() and clip_grad <= 0:
        return None, None
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    scaler.unscale_(optimizer)  # clip and test the true gradients, not scaled ones
    if clip_grad > 0:
        grad_norm = nn.utils.clip_grad_norm_(params, clip_grad)
    else:
        grad_norm = nn.utils.get_total_norm([p.grad for p in params])
    overflow = ~torch.isfinite(grad_norm) if scaler.is_enabled() else None
    return grad_norm.detach(), overflow
