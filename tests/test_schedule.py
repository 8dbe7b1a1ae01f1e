"""The LR is a pure function of the optimizer step: the same bits as the LambdaLR it replaced,
the MoCo CIFAR-10 demo's per-epoch cosine, and an exact resume that needs nothing but the step."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_ok, load_ckpt, read_scalars, run_cli
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ddp_utils.runtime.stopping import StepVerdict
from ddp_utils.train.accumulation import GradientAccumulator
from ddp_utils.train.schedule import LRSchedule, warmup_cosine_factor, warmup_step_factor

PEAK, TOTAL, MILESTONES = 0.05, 300, (120, 210)  # 0.05: not a power of two, so rounding would show
KINDS = [("cosine", 0), ("cosine", 25), ("step", 0), ("step", 25), ("constant", 0), ("constant", 25)]


def old_factor(kind: str, warmup: int):
    """The multiplier the previous version handed to LambdaLR (its ``_Factor``)."""
    if kind == "cosine":
        return lambda step: warmup_cosine_factor(step, warmup, TOTAL)
    return lambda step: warmup_step_factor(step, warmup, MILESTONES if kind == "step" else ())


@pytest.mark.parametrize("kind,warmup", KINDS)
def test_lr_at_step_is_the_old_lambdalr_sequence_bit_for_bit(kind, warmup):
    """The LR each optimizer step ran at under LambdaLR (stepped after the optimizer, as the
    accumulator did: the first step runs at factor(0)) equals LRSchedule(step), exactly."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = LambdaLR(opt, old_factor(kind, warmup))
    old = []
    for _ in range(TOTAL + 20):  # a little past the end: --max-steps never goes there, but no surprise
        old.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    schedule = LRSchedule(PEAK, kind, TOTAL, warmup, MILESTONES)
    new = [schedule(step) for step in range(TOTAL + 20)]
    assert new == old  # floats compared exactly
    assert len(set(new)) > 1 or kind == "constant" and warmup == 0


def _windows(lr_at=None, lr_scheduler=None, skip=frozenset()) -> list[float]:
    """The LR of every applied optimizer step of an accumulator (A=2, 40 windows); the windows
    in ``skip`` are dropped as if their loss had been NaN on some rank."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=PEAK)
    if lr_scheduler is not None:
        lr_scheduler = lr_scheduler(opt)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    windows = iter(range(10**6))

    def guard(nonfinite, overflow=None):  # what StepGuard would agree on, without the all_reduce
        return StepVerdict(nonfinite_ranks=int(next(windows) in skip))

    acc = GradientAccumulator(model, opt, 2, lr_at=lr_at, lr_scheduler=lr_scheduler, guard=guard)
    batches = [torch.randn(4, 3) for _ in range(80)]
    for micro, x in acc.micro_batches(batches):
        acc.backward(model(x).pow(2).mean(), micro)
    assert acc.step == 40
    return seen


def test_the_accumulator_sets_the_lr_the_lambdalr_gave_skipped_steps_included():
    """Through the accumulator: the first optimizer step, and every later one, runs at the LR
    LambdaLR gave it, and a skipped step still counts (as it did for the scheduler)."""
    schedule = LRSchedule(PEAK, "cosine", 40, 5)
    for skip in (frozenset(), frozenset({3, 17})):
        old = _windows(lr_scheduler=lambda opt: LambdaLR(opt, schedule.factor), skip=skip)
        new = _windows(lr_at=schedule, skip=skip)
        assert new == old == [schedule(s) for s in range(40) if s not in skip]


def test_a_resumed_accumulator_continues_at_its_step():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = LRSchedule(PEAK, "cosine", 100, 10)
    acc = GradientAccumulator(model, opt, 1, lr_at=schedule, step=37)
    (micro, x), = acc.micro_batches([torch.randn(2, 3)])
    acc.backward(model(x).sum(), micro)
    assert opt.param_groups[0]["lr"] == schedule(37) and acc.step == 38  # the LR that step used


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


# ----------------------------------------------------------------------------- resume, real CLI
def test_cosine_epoch_resume_mid_epoch_is_exact_and_ignores_an_old_lr_scheduler_entry(tmp_path):
    """One process, A=2, 11 optimizer steps per epoch, cosine-epoch with a warm-up. The run is
    resumed from its step-8 checkpoint (mid epoch 1), made to look like the previous version's
    (an "lr_scheduler" entry, "initial_lr" and another lr in the optimizer): to step 16 (mid
    epoch 2) it ends bit-identical to the uninterrupted run, the LR of each step taken from the
    step alone."""
    common = ["--device", "cpu", "--dataset", "digits", "--arch", "small_cnn", "--batch-size", "64",
              "--accum-steps", "2", "--lr", "0.05", "--lr-schedule", "cosine-epoch", "--warmup-steps", "3",
              "--epochs", "3", "--log-every", "1", "--max-steps", "16"]
    ref = tmp_path / "ref"
    assert_ok(run_cli("train_classifier.py", common + ["--ckpt-every", "4", "--keep-checkpoints", "4",
                                                       "--out", str(ref)]))
    saved = {load_ckpt(p)["step"]: p for p in ref.glob("checkpoint_*.pt")}
    assert sorted(saved) == [8, 11, 12, 16]  # every 4 steps, and the end of epoch 1 (step 11)
    old = load_ckpt(saved[8])
    assert (old["epoch"], old["batches_done"]) == (0, 16) and "lr_scheduler" not in old
    old["lr_scheduler"] = {"base_lrs": [0.05], "last_epoch": 8, "_step_count": 9, "_last_lr": [0.123],
                           "lr_lambdas": [{"kind": "cosine", "warmup_steps": 99, "total_steps": 7}]}
    for group in old["optimizer"]["param_groups"]:
        group["initial_lr"], group["lr"] = 0.05, 0.123
    part = tmp_path / "old_step8.pt"
    torch.save(old, part)
    resumed = tmp_path / "resumed"
    proc = run_cli("train_classifier.py", common + ["--resume", str(part), "--out", str(resumed)])
    assert_ok(proc)
    assert "step 8, in epoch 1, 16 batches" in proc.stdout
    a, b = load_ckpt(saved[16]), load_ckpt(resumed / "checkpoint_last.pt")
    assert (a["step"], a["epoch"], a["batches_done"]) == (b["step"], b["epoch"], b["batches_done"]) == (16, 1, 10)
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])
    # train/lr at step k is the LR step k ran at: schedule(k - 1), the same in both runs.
    schedule = LRSchedule(0.05, "cosine-epoch", 33, 3, steps_per_epoch=11)
    ref_lr, res_lr = read_scalars(ref / "tb")["train/lr"], read_scalars(resumed / "tb")["train/lr"]
    assert [s for s, _ in res_lr] == list(range(9, 17))
    assert dict(ref_lr) == {k: pytest.approx(schedule(k - 1), rel=1e-6) for k in range(1, 17)}  # float32 events
    assert dict(res_lr) == {k: dict(ref_lr)[k] for k in range(9, 17)}
    assert a["optimizer"]["param_groups"][0]["lr"] == b["optimizer"]["param_groups"][0]["lr"] == schedule(15)
    assert "initial_lr" not in b["optimizer"]["param_groups"][0] and "lr_scheduler" not in b
