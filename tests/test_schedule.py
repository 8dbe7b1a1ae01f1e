"""The LR is a pure function of the optimizer step: the same bits as a LambdaLR stepped after
every optimizer step, skipped steps counted, the MoCo CIFAR-10 demo's per-epoch cosine, and
torchvision's StepLR / ExponentialLR / CosineAnnealingLR stepped once per epoch after its warm-up.
(An exact resume on it: tests/test_training.py.)"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    ExponentialLR,
    LambdaLR,
    LinearLR,
    SequentialLR,
    StepLR,
)

from ddp_utils.train.accumulation import set_lr
from ddp_utils.train.optimization import (
    LRSchedule,
    cosine_annealing_factor,
    warmup_cosine_factor,
    warmup_step_factor,
)
from ddp_utils.train.run import RunState

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
    for kind in ("steplr", "exponentiallr"):
        with pytest.raises(ValueError, match="steps_per_epoch"):
            LRSchedule(0.1, kind, 10)
    with pytest.raises(ValueError, match="step_size"):
        LRSchedule(0.1, "steplr", 10, steps_per_epoch=2, step_size=0)
    for gamma in (0.0, -0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="gamma"):
            LRSchedule(0.1, "exponentiallr", 10, steps_per_epoch=2, gamma=gamma)
    for lr_min in (0.1, 0.2, -1e-5, math.nan):  # the floor is an LR below the peak, not a factor
        with pytest.raises(ValueError, match="lr_min"):
            LRSchedule(0.1, "cosineannealinglr", 10, steps_per_epoch=2, lr_min=lr_min)


# ----------------------------------------------------------------------------- torchvision's per-epoch schedulers
# train.py's --lr-scheduler steplr / exponentiallr / cosineannealinglr, after its --lr-warmup-epochs
# (LinearLR or ConstantLR, joined by SequentialLR), all stepped once per epoch.
EPOCHS, STEPS = 30, 7
MAIN = [("steplr", {"step_size": 2, "gamma": 0.973}), ("steplr", {"step_size": 3, "gamma": 0.1}),
        ("exponentiallr", {"gamma": 0.98}), ("cosineannealinglr", {"lr_min": 1e-5})]
WARMUPS = [(0, "linear", 0.01), (5, "linear", 0.01), (5, "linear", 0.1), (5, "constant", 0.01), (5, "constant", 0.1)]


def torch_main_scheduler(opt, kind: str, warmup_epochs: int, step_size=30, gamma=0.1, lr_min=0.0):
    """train.py's main scheduler for ``--lr-scheduler kind`` (its T_max: the epochs after the warm-up)."""
    if kind == "steplr":
        return StepLR(opt, step_size=step_size, gamma=gamma)
    if kind == "exponentiallr":
        return ExponentialLR(opt, gamma=gamma)
    return CosineAnnealingLR(opt, T_max=EPOCHS - warmup_epochs, eta_min=lr_min)


def torch_epoch_lrs(kind: str, warmup_epochs: int, method: str, decay: float, **main) -> list[float]:
    """The LR of each epoch under train.py's schedulers, stepped after each epoch."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=PEAK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SequentialLR's step(0) of the main scheduler at the hand-over
        scheduler = torch_main_scheduler(opt, kind, warmup_epochs, **main)
        if warmup_epochs:
            warm = (LinearLR(opt, start_factor=decay, total_iters=warmup_epochs) if method == "linear" else
                    ConstantLR(opt, factor=decay, total_iters=warmup_epochs))
            scheduler = SequentialLR(opt, schedulers=[warm, scheduler], milestones=[warmup_epochs])
        lrs = []
        for _ in range(EPOCHS):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
    return lrs


@pytest.mark.parametrize("kind,main", MAIN)
@pytest.mark.parametrize("warmup_epochs,method,decay", WARMUPS)
def test_every_step_runs_at_torchvisions_lr_of_its_epoch(kind, main, warmup_epochs, method, decay):
    """Over 30 epochs of 7 steps, each step's LR is that of its epoch under torch's schedulers.
    They chain: each epoch's LR is the last one times a ratio (gamma, LinearLR's and the cosine's),
    which rounds differently from our closed form by a few ulps, hence rel 1e-12; where neither
    multiplies (a constant warm-up, the peak before the first decay) the bits are the same."""
    schedule = LRSchedule(PEAK, kind, EPOCHS * STEPS, steps_per_epoch=STEPS, warmup_epochs=warmup_epochs,
                          warmup_method=method, warmup_decay=decay, **main)
    theirs = [lr for lr in torch_epoch_lrs(kind, warmup_epochs, method, decay, **main) for _ in range(STEPS)]
    ours = [schedule(step) for step in range(EPOCHS * STEPS)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0)
    first_main = warmup_epochs * STEPS
    assert ours[first_main:first_main + STEPS] == [PEAK] * STEPS  # the main schedule starts at the peak
    if warmup_epochs and method == "constant":
        assert ours[:first_main] == theirs[:first_main] == [PEAK * decay] * first_main
    assert len(set(ours)) > 2 and min(ours) > main.get("lr_min", 0.0)


@pytest.mark.parametrize("kind,main", MAIN)
def test_the_main_schedule_is_torchs_closed_form_bit_for_bit(kind, main):
    """After a 5-epoch warm-up, epoch 5 + t runs at the main scheduler's own closed form at epoch t
    (what torch computes for ``step(t)``), exactly: the floor enters as CosineAnnealingLR's
    ``eta_min + (base - eta_min) * ...``, not as a multiple of the peak."""
    warmup = 5
    schedule = LRSchedule(PEAK, kind, EPOCHS * STEPS, steps_per_epoch=STEPS, warmup_epochs=warmup, **main)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = torch_main_scheduler(opt, kind, warmup, **main)
    for t in range(EPOCHS - warmup):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # step(epoch) is deprecated; it is the closed form
            scheduler.step(t)
        assert schedule((warmup + t) * STEPS + 3) == opt.param_groups[0]["lr"], f"epoch {warmup + t}"
        assert schedule.factor((warmup + t) * STEPS) == pytest.approx(opt.param_groups[0]["lr"] / PEAK, rel=1e-15)


def test_without_a_floor_cosineannealinglr_keeps_its_bits():
    """lr_min 0 (the default) is the schedule as it was: peak x cosine_annealing_factor, exactly."""
    schedule = LRSchedule(PEAK, "cosineannealinglr", EPOCHS * STEPS, steps_per_epoch=STEPS, warmup_epochs=5,
                          lr_min=0.0)
    for step in range(5 * STEPS, EPOCHS * STEPS):
        assert schedule(step) == PEAK * cosine_annealing_factor(step // STEPS, 5, EPOCHS)


def test_warmup_steps_ramp_up_the_epoch_schedules():
    """--warmup-steps multiplies steplr / exponentiallr as it does the other epoch schedules."""
    for kind in ("steplr", "exponentiallr"):
        plain = LRSchedule(1.0, kind, 40, steps_per_epoch=4, step_size=1, gamma=0.5)
        ramped = LRSchedule(1.0, kind, 40, warmup_steps=6, steps_per_epoch=4, step_size=1, gamma=0.5)
        assert [ramped(s) for s in range(6)] == [plain(s) * (s + 1) / 6 for s in range(6)]
        assert [ramped(s) for s in range(6, 40)] == [plain(s) for s in range(6, 40)]
        assert plain(3) == 1.0 and plain(4) == 0.5 and plain(39) == 0.5 ** 9
