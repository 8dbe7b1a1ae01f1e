"""The optimisation of a run: SGD, the fp16 scaler and the learning rate of every optimizer step.

LR schedules are pure functions of the optimizer step (not micro-steps, not epochs):
``LRSchedule(...)(step)`` is the LR of the step taken after ``step`` others (applied or skipped).
Nothing of it lives in a checkpoint: a resumed run's LR follows from its step and its own flags."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .accumulation import grad_scaler, steps_per_epoch

LR_SCHEDULES = ("cosine", "step", "constant", "cosine-epoch")


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: linear from 1/warmup to 1 over ``warmup_steps``, then cosine down to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def warmup_step_factor(step: int, warmup_steps: int, milestones: Sequence[int], gamma: float = 0.1) -> float:
    """LR multiplier: linear warmup, then x ``gamma`` at each milestone (MoCo v1's schedule)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return gamma ** sum(step >= m for m in milestones)


def epoch_cosine_factor(epoch: int, epochs: int) -> float:
    """LR multiplier of the MoCo authors' CIFAR-10 demo: ``0.5 * (1 + cos(pi * epoch / epochs))``
    for the whole of epoch ``epoch``, counted from 1 (the demo's loop runs epochs 1..epochs), so
    the first epoch already trains below the peak and the last one at exactly 0."""
    return 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))


@dataclass(frozen=True)
class LRSchedule:
    """The LR of every optimizer step, after a linear warm-up of ``warmup_steps`` to ``peak``:
    ``cosine`` decays to 0 at ``total_steps``; ``step`` is x0.1 at each of ``milestones`` (steps);
    ``constant``; ``cosine-epoch`` takes one value per epoch of ``steps_per_epoch`` steps,
    ``peak * epoch_cosine_factor(e, epochs)``, which its warm-up multiplies (the LR rises to the
    epoch's value instead of dropping from the peak; without warm-up it is the demo's schedule)."""

    peak: float
    kind: str = "cosine"
    total_steps: int = 0
    warmup_steps: int = 0
    milestones: tuple[int, ...] = ()
    steps_per_epoch: int = 0  # cosine-epoch only

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown LR schedule {self.kind!r}; one of {', '.join(LR_SCHEDULES)}")
        if self.kind == "cosine-epoch" and self.steps_per_epoch < 1:
            raise ValueError("the cosine-epoch schedule needs steps_per_epoch >= 1")
        object.__setattr__(self, "milestones", tuple(self.milestones))  # a list is fine too

    @property
    def epochs(self) -> int:
        """Epochs the schedule spans (cosine-epoch)."""
        return max(1, -(-self.total_steps // max(1, self.steps_per_epoch)))

    def factor(self, step: int) -> float:
        """The multiplier of ``peak`` at optimizer step ``step`` (0-based)."""
        if self.kind == "cosine":
            return warmup_cosine_factor(step, self.warmup_steps, self.total_steps)
        if self.kind == "cosine-epoch":
            epoch = min(step // self.steps_per_epoch + 1, self.epochs)
            value = epoch_cosine_factor(epoch, self.epochs)
            return value * (step + 1) / self.warmup_steps if step < self.warmup_steps else value
        # "constant" is a step schedule without milestones: warm-up, then flat.
        return warmup_step_factor(step, self.warmup_steps, self.milestones if self.kind == "step" else ())

    def __call__(self, step: int) -> float:
        return self.peak * self.factor(step)  # LambdaLR's own product: the same bits


def parse_milestones(text: str, epochs: int | None = None) -> list[int]:
    """``"120,160"`` -> ``[120, 160]`` (epochs); ``"60%,80%"`` with ``epochs=200`` -> ``[120, 160]``
    (``round(N / 100 * epochs)``). Raises ValueError on anything else, and on a percentage
    without ``epochs``."""
    result = []
    for part in (p.strip() for p in text.split(",")):
        if part.endswith("%"):
            if epochs is None:
                raise ValueError(f"{part}: a percentage needs the number of epochs")
            percent = float(part[:-1])
            if not math.isfinite(percent):
                raise ValueError(f"{part}: not a number")
            result.append(round(percent / 100 * epochs))
        elif part:
            result.append(int(part))
    return sorted(result)


def cosine_to_one(base: float, step: int, total_steps: int) -> float:
    """A value rising from ``base`` to 1 on a half cosine (MoCo's momentum schedule, BYOL-style)."""
    progress = min(1.0, step / max(1, total_steps))
    return 1.0 - (1.0 - base) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sgd(params, lr: float, momentum: float, weight_decay: float, device: torch.device) -> torch.optim.SGD:
    """Fused SGD on CUDA, the multi-tensor (foreach) one elsewhere: the same update rule."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **fast)


class OptimizationFlags(Protocol):
    """The flags :func:`build_optimization` reads (``train_config.TrainConfig`` has them)."""

    lr: float
    momentum: float
    weight_decay: float
    epochs: int
    accum_steps: int
    lr_schedule: str
    warmup_steps: int
    amp: str

    def milestone_steps(self, steps_per_epoch: int) -> list[int]: ...


def build_optimization(cfg: OptimizationFlags, params, batches_per_epoch: int, device: torch.device):
    """SGD over ``params``, the LR of every optimizer step over all --epochs, the fp16 scaler
    (disabled for other precisions) and the number of optimizer steps in all."""
    optimizer = sgd(params, cfg.lr, cfg.momentum, cfg.weight_decay, device)
    epoch_steps = steps_per_epoch(batches_per_epoch, cfg.accum_steps)
    total_steps = cfg.epochs * epoch_steps
    lr_schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps,
                             tuple(cfg.milestone_steps(epoch_steps)), epoch_steps)
    return optimizer, lr_schedule, grad_scaler(cfg.amp, device), total_steps
