"""Gradient accumulation: numerically the same as one big batch, one all-reduce per optimizer step,
short windows scaled by their real length, and loss-scaler/clip work only on the synchronising step."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_ok, load_ckpt, run_cli, run_on_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_utils.models.backbones import build_model
from ddp_utils.train.accumulation import GradientAccumulator, MicroStep, plan_windows

DIGITS_LENET = ["--dataset", "digits", "--arch", "lenet", "--no-augment", "--device", "cpu",
                # constant LR: a cosine schedule's length depends on how many samples drop_last
                # keeps, which differs between the two batch geometries.
                "--lr", "0.05", "--lr-schedule", "constant", "--epochs", "1", "--log-every", "1"]


def test_accumulation_matches_one_big_batch(tmp_path):
    """2 ranks x A=4 x batch 8 (torchrun) == 1 process x A=1 x batch 64, through the real CLI."""
    steps = 4
    small = run_cli("train_classifier.py", DIGITS_LENET + ["--batch-size", "8", "--accum-steps", "4",
                    "--max-steps", str(steps), "--out", str(tmp_path / "ddp")], nproc=2)
    assert_ok(small)
    big = run_cli("train_classifier.py", DIGITS_LENET + ["--batch-size", "64", "--accum-steps", "1",
                  "--max-steps", str(steps), "--out", str(tmp_path / "single")], nproc=1)
    assert_ok(big)
    a, b = load_ckpt(tmp_path / "ddp/checkpoint_last.pt"), load_ckpt(tmp_path / "single/checkpoint_last.pt")
    assert a["step"] == b["step"] == steps
    assert a["world_size"] == 2 and b["world_size"] == 1
    torch.manual_seed(0)  # the scripts' --seed 0 initialisation
    initial = build_model("lenet", 10, 32).state_dict()
    moved = 0.0
    for name, value in a["model"].items():
        diff = (value - b["model"][name]).abs().max().item()
        assert diff < 1e-5, f"{name}: max abs difference {diff}"
        moved = max(moved, (value - initial[name]).abs().max().item())
    assert moved > 1e-3, "the weights barely moved: the comparison would prove nothing"
    # Both runs log the same global batch of 64.
    assert "global batch 64 = 2 rank(s) x 4 accum steps x 8" in small.stdout
    assert "global batch 64 = 1 rank(s) x 1 accum steps x 64" in big.stdout


def test_plan_windows_has_a_short_last_window():
    plan = plan_windows(10, 4)
    assert [m.window_size for m in plan] == [4] * 8 + [2] * 2
    assert [m.syncs for m in plan] == [False, False, False, True] * 2 + [False, True]
    assert plan_windows(3, 1) == [MicroStep(0, 1)] * 3


def test_short_final_window_is_scaled_by_its_real_size():
    """Epoch of 7 micro-batches, A=3: windows 3, 3, 1. The last step must apply the plain mean
    gradient of its single micro-batch (scaled by 1, not 1/3)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    batches = [(torch.randn(4, 5), torch.randint(3, (4,))) for _ in range(7)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # update == -gradient
    accumulator = GradientAccumulator(model, optimizer, accum_steps=3)
    snapshots = []
    for micro, (x, y) in accumulator.micro_batches(batches):
        if micro.index == 0:
            snapshots.append(copy.deepcopy(model))
        with accumulator.sync_context(micro):
            accumulator.backward(nn.functional.cross_entropy(model(x), y), micro)
    windows = [batches[0:3], batches[3:6], batches[6:7]]
    final = model
    for before, after, window in zip(snapshots, snapshots[1:] + [final], windows):
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        reference = copy.deepcopy(before)
        nn.functional.cross_entropy(reference(x), y).backward()  # mean over the window's samples
        for p_before, p_after, p_ref in zip(before.parameters(), after.parameters(), reference.parameters()):
            torch.testing.assert_close(p_before - p_after, p_ref.grad, rtol=1e-6, atol=1e-7)
    # The wrong scaling (1/A for the last window) would have moved it 3x less: make sure it did not.
    last_step = [(a - b).abs().sum() for a, b in zip(snapshots[-1].parameters(), final.parameters())]
    assert sum(last_step) > 0


class _CountingScaler(torch.amp.GradScaler):
    def __init__(self):
        super().__init__("cpu", init_scale=2.0**10)
        self.calls = {"unscale_": 0, "update": 0}

    def unscale_(self, optimizer):
        self.calls["unscale_"] += 1
        return super().unscale_(optimizer)


    def update(self, new_scale=None):
        self.calls["update"] += 1
        return super().update(new_scale)


def test_fp16_scaler_and_clipping_run_only_on_the_synchronising_micro_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer_steps = []
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = _CountingScaler()
    accumulator = GradientAccumulator(model, optimizer, accum_steps=4, lr_scheduler=scheduler,
                                      grad_scaler=scaler, clip_grad=1.0)
    batches = [(torch.randn(4, 8), torch.randint(2, (4,))) for _ in range(10)]  # windows 4, 4, 2
    results = []
    for micro, (x, y) in accumulator.micro_batches(batches):
        with accumulator.sync_context(micro), torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        results.append(accumulator.backward(loss, micro))
        if not micro.syncs:  # gradients accumulate (still scaled) between optimizer steps
            assert all(p.grad is not None for p in model.parameters())
        else:  # ... and are released right after the step
            assert all(p.grad is None for p in model.parameters())
    steps = [r for r in results if r is not None]
    assert len(steps) == 3
    # unscaled once per window; the optimizer steps on the unscaled gradients (no GradScaler.step)
    assert scaler.calls == {"unscale_": 3, "update": 3} and len(optimizer_steps) == 3
    assert scheduler.last_epoch == 3
    assert all(r.grad_norm is not None and not r.skipped for r in steps)


def test_an_fp16_overflow_skips_the_step_and_lowers_the_scale():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accumulator = GradientAccumulator(model, optimizer, accum_steps=2, grad_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 4)
    results = []
    for micro, scale in accumulator.micro_batches([1.0, float("inf")]):  # the 2nd micro-batch overflows
        loss = (model(x) * scale).sum() if scale != float("inf") else (model(x) * 1e38).sum() * 1e38
        results.append(accumulator.backward(loss, micro))
    assert results[-1].skipped and results[-1].verdict.overflow
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved
    assert scaler.get_scale() == 2.0**9  # halved by update()
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- communication
def _count_allreduce(info, accum_steps: int, optimizer_steps: int):
    """Train a small DDP model; a comm hook counts every bucket all-reduce and its bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(0)
    # 2.9 MB of gradients in 0.25 MB buckets (DDP's first bucket holds up to 1 MB): one "round"
    # over the buckets is several calls.
    model = DDP(nn.Sequential(nn.Linear(32, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(),
                              nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 4)), bucket_cap_mb=0.25)
    calls = {"n": 0, "bytes": 0}

    def counting_hook(state, bucket):
        calls["n"] += 1
        calls["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    accumulator = GradientAccumulator(model, optimizer, accum_steps)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_step = []
    batches = [(torch.randn(8, 32), torch.randint(4, (8,))) for _ in range(accum_steps * optimizer_steps)]
    for micro, (x, y) in accumulator.micro_batches(batches):
        before = dict(calls)
        with accumulator.sync_context(micro):
            step = accumulator.backward(nn.functional.cross_entropy(model(x), y), micro)
        if step is None:
            assert calls == before, "a no_sync micro-step communicated"
        else:
            per_step.append((calls["n"] - before["n"], calls["bytes"] - before["bytes"]))
    params = [p.detach().clone() for p in model.parameters()]
    return {"per_step": per_step, "grad_bytes": grad_bytes, "params": params}


@pytest.mark.parametrize("accum_steps", [1, 2, 4])
def test_gradients_are_all_reduced_once_per_optimizer_step(tmp_path, accum_steps):
    results = run_on_ranks(_count_allreduce, tmp_path, accum_steps, 3)
    for r in results:
        assert len(r["per_step"]) == 3
        calls = [c for c, _ in r["per_step"]]
        # DDP re-buckets by gradient-ready order after its first step, hence calls[0] may differ.
        assert len(set(calls[1:])) == 1 and calls[1] > 1, f"expected several, stable buckets: {calls}"
        # One round over all buckets per optimizer step: every gradient byte exactly once.
        assert all(b == r["grad_bytes"] for _, b in r["per_step"]), r["per_step"]
    for p0, p1 in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p0, p1), "ranks diverged"


def _count_agreements(info, accum_steps: int, optimizer_steps: int):
    """The per-step agreement of ddp_utils.runtime.stopping: python-level all_reduce calls per micro-step."""
    import torch.distributed as dist

    from ddp_utils.runtime import collectives
    from ddp_utils.runtime.stopping import StepGuard

    calls = {"n": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls["n"] += 1
        return real_all_reduce(*args, **kwargs)

    collectives.dist.all_reduce = counting_all_reduce
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 4))
    accumulator = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accum_steps,
                                      guard=StepGuard(None, info.device))
    per_micro = []
    for micro, (x, y) in accumulator.micro_batches([(torch.randn(4, 8), torch.randint(4, (4,)))] *
                                                   (accum_steps * optimizer_steps)):
        before = calls["n"]
        with accumulator.sync_context(micro):
            accumulator.backward(nn.functional.cross_entropy(model(x), y), micro)
        per_micro.append(calls["n"] - before)
    return per_micro


def test_the_stop_agreement_is_one_all_reduce_per_optimizer_step(tmp_path):
    """Signals, Ctrl-C and non-finite losses travel in one collective, on the synchronising
    micro-step only (DDP's gradient all-reduce runs in C++ and is not counted here)."""
    for per_micro in run_on_ranks(_count_agreements, tmp_path, 3, 2):
        assert per_micro == [0, 0, 1, 0, 0, 1]
