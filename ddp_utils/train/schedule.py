"""Learning-rate schedules, counted in optimizer steps (not micro-steps, not epochs)."""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR


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


LR_SCHEDULES = ("cosine", "step", "constant")


class _Factor:
    # A small class instead of a lambda: its attributes land in LambdaLR's state_dict as plain data.
    def __init__(self, kind: str, warmup_steps: int, total_steps: int, milestones: Sequence[int] = ()):
        self.kind, self.warmup_steps, self.total_steps = kind, warmup_steps, total_steps
        self.milestones = list(milestones)

    def __call__(self, step: int) -> float:
        if self.kind == "cosine":
            return warmup_cosine_factor(step, self.warmup_steps, self.total_steps)
        # "constant" is a step schedule without milestones: warm-up, then flat.
        return warmup_step_factor(step, self.warmup_steps, self.milestones if self.kind == "step" else ())


def build_lr_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup_steps: int,
                       total_steps: int, milestones: Sequence[int] = ()) -> LambdaLR:
    """``kind`` in LR_SCHEDULES; ``milestones`` (optimizer steps) only matter for "step"."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"unknown LR schedule {kind!r}")
    return LambdaLR(optimizer, _Factor(kind, warmup_steps, total_steps, milestones))


def parse_milestones(text: str) -> list[int]:
    """``"120,160"`` -> ``[120, 160]`` (epochs); raises ValueError on anything else."""
    return sorted(int(part) for part in text.split(",") if part.strip())


def cosine_to_one(base: float, step: int, total_steps: int) -> float:
    """A value rising from ``base`` to 1 on a half cosine (MoCo's momentum schedule, BYOL-style)."""
    progress = min(1.0, step / max(1, total_steps))
    return 1.0 - (1.0 - base) * 0.5 * (1.0 + math.cos(math.pi * progress))
