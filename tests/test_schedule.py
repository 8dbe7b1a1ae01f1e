"""The LR is a pure function of the optimizer step: the same bits as a LambdaLR stepped after
every optimizer step, skipped steps counted, and the MoCo CIFAR-10 demo's per-epoch cosine. (An
exact resume on it: tests/test_training.py.)"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ddp_utils.train.accumulation import set_lr
from ddp_utils.train.optimization import LRSchedule, warmup_cosine_factor, warmup_step_factor
from ddp_utils.train.run_state import RunState

PEAK, TOTAL, MILESTONES = 0.05, 300, (120, 210)  # 0.05: not a power of two, so rounding would show
KINDS = [("cosine", 0), ("cosine", 25), ("step", 0), ("step", 25), ("constant", 0), ("constant", 25)]


def lambda_factor(kind: str, warmup: int):
    """The multiplier of each schedule, as one would hand it to LambdaLR."""
    if kind == "cosine":
        return lambda step: warmup_cosine_factor(step, warmup, TOTAL)
    return lambda step: warmup_step_factor(step, warmup, MILESTONES if kind == "step" else ())


@pytest.mark.parametrize("kind,warmup", KINDS)
def test_lr_at_step_is_the_lambdalr_sequence_bit_for_bit(kind, warmup):
    """The LR each optimizer step runs at under a LambdaLR stepped after the optimizer (the first
    step runs at factor(0)) equals LRSchedule(step), exactly."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = LambdaLR(opt, lambda_factor(kind, warmup))
    lambda_lrs = []
    for _ in range(TOTAL + 20):  # a little past the end: --max-steps never goes there, but no surprise
        lambda_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    schedule = LRSchedule(PEAK, kind, TOTAL, warmup, MILESTONES)
    new = [schedule(step) for step in range(TOTAL + 20)]
    assert new == lambda_lrs  # floats compared exactly
    assert len(set(new)) > 1 or kind == "constant" and warmup == 0


def _applied_lrs(schedule: LRSchedule, skip=frozenset()) -> list[float]:
    """The LR of every applied optimizer step over 40 steps taken as the scripts take them (plain
    objects: the LR of the step's count, then step or skip, then count it); the steps in ``skip``
    are dropped as if their loss had been NaN on some rank."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=PEAK)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    state, scaler = RunState(), torch.amp.GradScaler("cpu", enabled=False)
    for step in range(40):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        loss.backward()
        set_lr(opt, schedule(state.step))
        if step not in skip:
            opt.step()
        scaler.update()
        opt.zero_grad()
        state.step += 1
    assert state.step == 40
    return seen


def test_each_step_runs_at_the_lambdalr_lr_skipped_steps_included():
    """The first optimizer step, and every later one, runs at the LR a LambdaLR stepped after each
    optimizer step gives, and a skipped step still counts."""
    schedule = LRSchedule(PEAK, "cosine", 40, 5)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler, lambda_lrs = LambdaLR(opt, schedule.factor), []
    for _ in range(40):
        lambda_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    for skip in (frozenset(), frozenset({3, 17})):
        assert _applied_lrs(schedule, skip) == [lr for s, lr in enumerate(lambda_lrs) if s not in skip]


# ----------------------------------------------------------------------------- cosine-epoch
# The demo's own log (facebookresearch/moco, branch colab-notebook, colab/moco_cifar10_demo.ipynb:
# lr 0.06, 200 epochs, "Train Epoch: [e/200], lr: ..." printed with 6 decimals).
DEMO_LOG = {1: "0.059996", 2: "0.059985", 3: "0.059967", 198: "0.000015", 199: "0.000004", 200: "0.000000"}


def test_cosine_epoch_is_the_demos_schedule():
    steps_per_epoch = 97  # the demo: 50,000 // 512
    schedule = LRSchedule(0.06, "cosine-epoch", 200 * steps_per_epoch, steps_per_epoch=steps_per_epoch)
    assert schedule.epochs == 200
    for epoch, printed in DEMO_LOG.items():
        first, last = (epoch - 1) * steps_per_epoch, epoch * steps_per_epoch - 1
        values = {schedule(step) for step in range(first, last + 1)}
        assert len(values) == 1, f"epoch {epoch} is not constant"
        assert f"{values.pop():.6f}" == printed
        assert schedule(first) == 0.06 * 0.5 * (1.0 + math.cos(math.pi * epoch / 200))
    assert schedule(0) < 0.06  # epoch 1 is already below the peak
    assert schedule(200 * steps_per_epoch - 1) == 0.0  # the last epoch trains at exactly 0
    assert schedule(200 * steps_per_epoch + 5) == 0.0  # past the end it stays there
    assert schedule(steps_per_epoch) < schedule(steps_per_epoch - 1)  # it changes at the boundary


def test_cosine_epoch_warmup_rises_to_the_epochs_value():
    schedule = LRSchedule(1.0, "cosine-epoch", 40, warmup_steps=8, steps_per_epoch=10)  # 4 epochs
    epoch1 = 0.5 * (1.0 + math.cos(math.pi / 4))
    assert [schedule(s) for s in range(8)] == [epoch1 * (s + 1) / 8 for s in range(8)]
    assert schedule(7) == schedule(8) == schedule(9) == epoch1  # no jump when the warm-up ends
    assert schedule(10) == 0.5 and schedule(39) == 0.0


def test_bad_definitions_are_refused():
    with pytest.raises(ValueError, match="unknown LR schedule"):
        LRSchedule(0.1, "linear", 10)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        LRSchedule(0.1, "cosine-epoch", 10)
