"""Gradient accumulation under DDP, done the one correct way.

A window of ``A`` micro-batches makes one optimizer step. For every micro-batch:

* forward and backward run at once, so each micro-batch's graph is freed by its own backward
  (never ``retain_graph``): no graph outlives its micro-step, memory does not grow with ``A``, and
  no backward can ever see weights that ``optimizer.step()`` changed in place;
* the loss is divided by the window's real length, so the summed gradient is the mean over the
  window (DDP then averages over ranks: the mean over world_size x window x batch_size samples);
  the last window of an epoch may be shorter than ``A`` and is divided by its own length;
* micro-steps 1..n-1 of a window run inside ``model.no_sync()``; the n-th synchronises, so
  gradients cross the network once per optimizer step.

Only on the synchronising micro-step: unscale (fp16) and clip, the ranks' agreement (an optional
``guard``: did any rank see a non-finite loss in this window, did any receive a stop signal, did
fp16 gradients overflow), then the LR, optimizer step, scaler update and
``zero_grad(set_to_none=True)``. That agreement is the optimizer step's only host read. A window
whose loss was NaN or Inf on any rank is not applied: its gradients are dropped on every rank.

The learning rate: with ``lr_at`` (a function of the optimizer step, e.g.
``schedule.LRSchedule``), every param group's ``lr`` is set to ``lr_at(step)`` just before each
optimizer step, where ``step`` counts the optimizer steps this accumulator ended before it,
applied or skipped (a resumed run passes its saved step as ``step=``; the attribute ``step``
holds the count). After a window ``param_groups[i]["lr"]`` is the LR that window used, whether or
not it was applied. A torch ``lr_scheduler=`` is still accepted: it is stepped after every
optimizer step, applied or skipped.

Usage::

    for micro, (images, targets) in accumulator.micro_batches(loader):
        with accumulator.sync_context(micro):
            with autocast(...):
                loss = criterion(model(images), targets)
            step = accumulator.backward(loss, micro)  # a StepResult on the window's last micro-step
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator, TypeVar

import torch
from torch import nn

from ..runtime.stopping import StepVerdict

B = TypeVar("B")


@dataclass(frozen=True)
class MicroStep:
    index: int        # position inside its window, 0-based
    window_size: int  # micro-batches in this window (A, or fewer for an epoch's last window)

    @property
    def syncs(self) -> bool:
        """True for the micro-step that all-reduces gradients and steps the optimizer."""
        return self.index == self.window_size - 1


@dataclass(frozen=True)
class StepResult:
    grad_norm: torch.Tensor | None  # total L2 norm before clipping (fp16 or --clip-grad), on the device
    skipped: bool            # the weights did not move: a non-finite loss, or fp16 overflow
    verdict: StepVerdict = field(default_factory=StepVerdict)  # what the ranks agreed on


def plan_windows(num_micro_batches: int, accum_steps: int) -> list[MicroStep]:
    """The micro-step plan for an epoch: full windows of ``accum_steps``, then the remainder."""
    plan = []
    for start in range(0, num_micro_batches, accum_steps):
        size = min(accum_steps, num_micro_batches - start)
        plan += [MicroStep(i, size) for i in range(size)]
    return plan


class GradientAccumulator:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, accum_steps: int, *,
                 lr_at: Callable[[int], float] | None = None, step: int = 0,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None, clip_grad: float = 0.0,
                 guard: Callable[..., StepVerdict] | None = None):
        if accum_steps < 1:
            raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
        self.model, self.optimizer, self.accum_steps = model, optimizer, accum_steps
        self.lr_at, self.step = lr_at, step  # step: optimizer steps ended so far, applied or skipped
        self.lr_scheduler, self.grad_scaler, self.clip_grad = lr_scheduler, grad_scaler, clip_grad
        self.guard = guard  # e.g. stopping.StepGuard: one all_reduce per optimizer step
        self._nonfinite: torch.Tensor | None = None  # on the device: any NaN/Inf loss in this window
        self.optimizer.zero_grad(set_to_none=True)

    def micro_batches(self, batches: Iterable[B]) -> Iterator[tuple[MicroStep, B]]:
        """Pair each batch with its place in its window; ``batches`` must have a length."""
        plan = plan_windows(len(batches), self.accum_steps)  # type: ignore[arg-type]
        yield from zip(plan, batches)

    def sync_context(self, micro: MicroStep) -> ContextManager:
        """``no_sync()`` on every micro-step but the window's last; wrap forward *and* backward."""
        if micro.syncs or not hasattr(self.model, "no_sync"):  # a bare module has nothing to sync
            return contextlib.nullcontext()
        return self.model.no_sync()

    def backward(self, loss: torch.Tensor, micro: MicroStep) -> StepResult | None:
        """Back-propagate this micro-batch's share of the loss; step on the window's last one."""
        if self.guard is not None:  # device ops only: no host sync per micro-step
            bad = ~torch.isfinite(loss.detach())
            self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad
        scaled = loss / micro.window_size
        if self.grad_scaler is not None:
            scaled = self.grad_scaler.scale(scaled)
        scaled.backward()
        return self._end_window() if micro.syncs else None

    def _end_window(self) -> StepResult:
        grad_norm, overflow = self._unscale_and_measure()
        if self.guard is not None:
            verdict = self.guard(self._nonfinite, overflow)
        else:  # no agreement to piggyback on: the overflow flag costs its own read
            verdict = StepVerdict(overflow=overflow is not None and bool(overflow))
        self._nonfinite = None
        if verdict.nonfinite_ranks:  # every rank agreed: drop this window, keep the weights
            self._finish_step(apply=False)
            return StepResult(None, True, verdict)
        skipped = verdict.overflow  # fp16: an overflowing step is skipped and the loss scale lowered
        self._finish_step(apply=not skipped)
        return StepResult(grad_norm, skipped, verdict)

    def _unscale_and_measure(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fp16: unscale the gradients; with --clip-grad: clip them. Returns the pre-clip total
        norm and fp16's overflow flag, both still on the device (no host read here)."""
        if self.grad_scaler is None and self.clip_grad <= 0:
            return None, None
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)  # clip and test true gradients, not scaled ones
        if self.clip_grad > 0:
            grad_norm = nn.utils.clip_grad_norm_(params, self.clip_grad)
        else:
            grad_norm = nn.utils.get_total_norm([p.grad for p in params])
        overflow = None if self.grad_scaler is None else ~torch.isfinite(grad_norm)
        return grad_norm.detach(), overflow

    def _finish_step(self, apply: bool) -> None:
        """Set this step's LR, step the optimizer (when ``apply``), then the scaler, count the step
        (the schedule counts optimizer steps, applied or not) and release the gradients.

        The gradients are already unscaled, so the optimizer steps directly: ``GradScaler.step``
        would only repeat the overflow test with a host read of its own. ``update()`` lowers the
        scale after an overflow (from what ``unscale_`` recorded) and raises it after enough good steps.
        """
        if self.lr_at is not None:
            lr = self.lr_at(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if apply:
            self.optimizer.step()
        if self.grad_scaler is not None:
            self.grad_scaler.update()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
