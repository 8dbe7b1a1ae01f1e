"""Gradient accumulation: numerically the same as one big batch, one all-reduce per optimizer step,
short windows scaled by their real length, and loss-scaler/clip work only in the optimizer step."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_ok, bare_run, in_process, load_ckpt, run_cli, run_on_ranks, train_windows
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import train_classifier
from ddp_utils.models.backbones import build_model
from ddp_utils.train.accumulation import MicroStep, plan_windows

DIGITS_LENET = ["--dataset", "digits", "--arch", "lenet", "--no-augment", "--device", "cpu",
                # constant LR: a cosine schedule's length depends on how many samples drop_last
                # keeps, which differs between the two batch geometries.
                "--lr", "0.05", "--lr-schedule", "constant", "--epochs", "1", "--log-every", "1"]


def test_accumulation_matches_one_big_batch(tmp_path, capsys):
    """2 ranks x A=4 x batch 8 (torchrun) == 1 process x A=1 x batch 64, through the scripts."""
    steps = 4
    small = run_cli("train_classifier.py", DIGITS_LENET + ["--batch-size", "8", "--accum-steps", "4",
                    "--max-steps", str(steps), "--out", str(tmp_path / "ddp")], nproc=2)
    assert_ok(small)
    big = in_process(train_classifier.main, DIGITS_LENET + ["--batch-size", "64", "--accum-steps", "1",
                     "--max-steps", str(steps), "--out", str(tmp_path / "single")], capsys)
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
    assert [m.is_last for m in plan] == [False, False, False, True] * 2 + [False, True]
    assert plan_windows(3, 1) == [MicroStep(0, 1)] * 3


def test_short_final_window_is_scaled_by_its_real_size():
    """Epoch of 7 micro-batches, A=3: windows 3, 3, 1. The last step must apply the plain mean
    gradient of its single micro-batch (scaled by 1, not 1/3)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    batches = [(torch.randn(4, 5), torch.randint(3, (4,))) for _ in range(7)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # update == -gradient
    run = bare_run(model, optimizer, accum_steps=3)
    windows = [batches[0:3], batches[3:6], batches[6:7]]  # what plan_windows(7, 3) makes of the epoch
    snapshots = []
    for window in windows:
        snapshots.append(copy.deepcopy(model))
        train_windows(run, window, lambda net, b: nn.functional.cross_entropy(net(b[0]), b[1]))
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


def test_fp16_scaler_and_clipping_run_only_in_the_optimizer_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer_steps = []
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))
    scaler = _CountingScaler()
    run = bare_run(model, optimizer, accum_steps=4, scaler=scaler, clip_grad=1.0)
    batches = [(torch.randn(4, 8), torch.randint(2, (4,))) for _ in range(10)]  # windows 4, 4, 2
    grads_between = []

    def loss(net, batch):
        grads_between.append([p.grad is not None for p in net.parameters()])
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.functional.cross_entropy(net(batch[0]), batch[1])

    results = train_windows(run, batches, loss)
    steps = [r for r in results if r is not None]
    assert len(steps) == 3 and run.state.step == 3
    # gradients accumulate (still scaled) within a window, and are released by the step
    assert [all(g) for g in grads_between] == [False, True, True, True] * 2 + [False, True]
    assert all(p.grad is None for p in model.parameters())
    # unscaled once per window; the optimizer steps on the unscaled gradients (no GradScaler.step)
    assert scaler.calls == {"unscale_": 3, "update": 3} and len(optimizer_steps) == 3
    assert all(r.grad_norm is not None and r.applied for r in steps)


def test_an_fp16_overflow_skips_the_step_and_lowers_the_scale():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    run = bare_run(model, optimizer, accum_steps=2, scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 4)
    # the 2nd micro-batch's loss is finite (about 1e36), its scaled gradients overflow (x 1024)
    results = train_windows(run, [1.0, 1e36], lambda net, scale: net(x).sum() * scale)
    assert not results[-1].applied and results[-1].verdict.overflow and not results[-1].verdict.nonfinite_ranks
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved
    assert scaler.get_scale() == 2.0**9  # halved by update()
    assert all(p.grad is None for p in model.parameters()) and run.state.step == 1


# ----------------------------------------------------------------------------- communication
def _count_allreduce(info, accum_steps: int, optimizer_steps: int):
    """Train a small DDP model; a comm hook counts every bucket all-reduce and its bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(0)
    # 2.9 MB of gradients in 0.25 MB buckets (DDP's first bucket holds up to 1 MB): one "round"
    # over the buckets is several calls.
    model = DDP(nn.Sequential(nn.Linear(32, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(),
                              nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 4)), bucket_cap_mb=0.25,
                gradient_as_bucket_view=True)  # as wrap_network builds it
    calls = {"n": 0, "bytes": 0}

    def counting_hook(state, bucket):
        calls["n"] += 1
        calls["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = bare_run(model, optimizer, accum_steps=accum_steps)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_micro, grad_storage = [], []

    def loss(net, batch):  # counts what the previous micro-step's backward sent
        per_micro.append(dict(calls))
        grad_storage.append(tuple(None if p.grad is None else p.grad.data_ptr() for p in model.parameters()))
        return nn.functional.cross_entropy(net(batch[0]), batch[1])

    batches = [(torch.randn(8, 32), torch.randint(4, (8,))) for _ in range(accum_steps * optimizer_steps)]
    results = train_windows(run, batches, loss)
    per_micro.append(dict(calls))
    per_step = []
    for before, after, result in zip(per_micro, per_micro[1:], results):
        if result is None:
            assert after == before, "a no_sync micro-step communicated"
        else:
            per_step.append((after["n"] - before["n"], after["bytes"] - before["bytes"]))
    params = [p.detach().clone() for p in model.parameters()]
    grads_after = [None if p.grad is None else p.grad.count_nonzero().item() for p in model.parameters()]
    return {"per_step": per_step, "grad_bytes": grad_bytes, "params": params,
            "grads_after": grads_after, "grad_storage": grad_storage}


def _communication(info) -> dict:
    """Both counts on one 2-rank job: bucket all-reduces for A = 1, 2, 4, and agreements for A = 3."""
    return {"allreduce": {a: _count_allreduce(info, a, 3) for a in (1, 2, 4)},
            "agreements": _count_agreements(info, 3, 2)}


@pytest.fixture(scope="module")
def communication(tmp_path_factory) -> list[dict]:
    return run_on_ranks(_communication, tmp_path_factory.mktemp("communication"))


@pytest.mark.parametrize("accum_steps", [1, 2, 4])
def test_gradients_are_all_reduced_once_per_optimizer_step(communication, accum_steps):
    results = [rank["allreduce"][accum_steps] for rank in communication]
    for r in results:
        assert len(r["per_step"]) == 3
        calls = [c for c, _ in r["per_step"]]
        # DDP re-buckets by gradient-ready order after its first step, hence calls[0] may differ.
        assert len(set(calls[1:])) == 1 and calls[1] > 1, f"expected several, stable buckets: {calls}"
        # One round over all buckets per optimizer step: every gradient byte exactly once.
        assert all(b == r["grad_bytes"] for _, b in r["per_step"]), r["per_step"]
    for p0, p1 in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p0, p1), "ranks diverged"


def test_ddp_gradients_stay_in_the_buckets_across_steps(communication):
    """gradient_as_bucket_view=True pays off only if the gradients are zeroed in place: set to
    None, autograd would allocate new ones each step and DDP copy them into its buckets. After
    the last step every gradient exists and is zero (none leaks into the next step), and once
    DDP has rebuilt its buckets (in the second step's first forward) every micro-step sees the
    same gradient storage."""
    for rank in communication:
        r = rank["allreduce"][2]
        assert r["grads_after"] == [0] * len(r["grads_after"])
        later = r["grad_storage"][3:]  # recorded before each forward: micro-steps 4, 5, 6
        assert None not in later[0] and len(set(later)) == 1


def _count_agreements(info, accum_steps: int, optimizer_steps: int):
    """The per-step agreement of ddp_utils.runtime.stopping: python-level all_reduce calls per micro-step."""
    import torch.distributed as dist

    from ddp_utils.runtime import collectives

    calls = {"n": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls["n"] += 1
        return real_all_reduce(*args, **kwargs)

    collectives.dist.all_reduce = counting_all_reduce
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 4))
    run = bare_run(model, torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=accum_steps)
    marks = []

    def loss(net, batch):
        marks.append(calls["n"])
        return nn.functional.cross_entropy(net(batch[0]), batch[1])

    train_windows(run, [(torch.randn(4, 8), torch.randint(4, (4,)))] * (accum_steps * optimizer_steps), loss)
    marks.append(calls["n"])
    return [b - a for a, b in zip(marks, marks[1:])]


def test_the_stop_agreement_is_one_all_reduce_per_optimizer_step(communication):
    """Signals, Ctrl-C and non-finite losses travel in one collective, on a window's last
    micro-step only (DDP's gradient all-reduce runs in C++ and is not counted here)."""
    for rank in communication:
        assert rank["agreements"] == [0, 0, 1, 0, 0, 1]
