"""Gradient accumulation: numerically the same as one big batch, one all-reduce per optimizer step,
short windows scaled by their real length, and loss-scaler/clip work only in the optimizer step."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_ok, in_process, load_ckpt, run_on_ranks, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import train_classifier
from ddp_utils.data.sets import DigitsDataset
from ddp_utils.models.backbones import build_model
from ddp_utils.runtime.stopping import StepGuard
from ddp_utils.train.accumulation import MicroStep, fp16_overflow, no_sync, plan_windows, set_lr
from ddp_utils.train.run import RunState, TrainingBatches, WindowUndo

DIGITS_LENET = ["--dataset", "digits", "--arch", "lenet", "--no-augment", "--device", "cpu",
                # constant LR: a cosine schedule's length depends on how many samples drop_last
                # keeps, which differs between the two batch geometries.
                "--lr", "0.05", "--lr-schedule", "constant", "--epochs", "1", "--log-every", "1"]


def test_accumulation_matches_one_big_batch(tmp_path, capsys):
    """2 ranks x A=4 x batch 8 (torchrun) == 1 process x A=1 x batch 64, through the scripts."""
    steps = 4
    small = run_ranks("train_classifier.py", DIGITS_LENET + ["--batch-size", "8", "--accum-steps", "4",
                      "--max-steps", str(steps), "--out", str(tmp_path / "ddp")], tmp_path)
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


class StepRecorder:
    """Global hooks (PyTorch's public ones) around the real script: every forward's input, and at
    each optimizer step the weights and gradients it starts from."""

    def __init__(self, model_type: str):
        self.model_type, self.inputs, self.steps = model_type, [], []

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def on_forward(module, args):
            if type(module).__name__ == self.model_type and module.training:
                self.inputs.append(args[0].detach().clone())

        def on_step(optimizer, args, kwargs):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.steps.append(([p.detach().clone() for p in params], [p.grad.detach().clone() for p in params],
                               len(self.inputs)))

        self.handles = [register_module_forward_pre_hook(on_forward), register_optimizer_step_pre_hook(on_step)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


class CountingForward(nn.Module):
    """A module whose forward changes state the optimizer does not hold: a count of forwards."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return x

    def forward_state(self) -> int:
        return self.forwards

    def restore_forward_state(self, forwards: int) -> None:
        self.forwards = forwards


class ListLoaders:
    """What TrainingBatches reads of data.pipeline.Loaders: one epoch of fixed batches."""

    def __init__(self, batches: list[torch.Tensor]):
        self.train, self.batches_per_epoch = batches, len(batches)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        pass

    def stop_making(self, *passes) -> None:
        pass


def test_an_undone_window_restores_what_is_registered_and_only_that():
    """A window given up (TrainingBatches.undo_window) puts back the BatchNorm statistics, the RNG
    stream and the count of a registered module as the window began; a module with the same
    methods that is not registered (a negative control: nothing is found by its methods) keeps
    the window's count."""
    torch.manual_seed(0)
    registered, unregistered = CountingForward(), CountingForward()
    model = nn.Sequential(registered, unregistered, nn.BatchNorm1d(3))
    state = RunState()
    batches = TrainingBatches(ListLoaders([torch.randn(4, 3) for _ in range(4)]), state, accum_steps=2,
                              model=model, device=torch.device("cpu"))
    batches.window_undo.register(registered)
    epoch = batches.this_epoch()
    for _ in range(2):  # the first window, completed
        _, batch = next(epoch)
        model(batch)
    kept = {name: b.clone() for name, b in model[2].named_buffers()}
    draw = torch.get_rng_state()
    for _ in range(2):  # the second window, given up after its forwards
        _, batch = next(epoch)
        model(batch)
        torch.rand(5)
    assert registered.forwards == unregistered.forwards == 4 and state.batches_done == 4
    assert not torch.equal(model[2].running_mean, kept["running_mean"])
    batches.undo_window()
    assert state.batches_done == 2
    assert registered.forwards == 2  # registered: restored
    assert unregistered.forwards == 4  # not registered: left as the window changed it
    for name, value in model[2].named_buffers():
        assert torch.equal(value, kept[name]), name
    assert torch.equal(torch.get_rng_state(), draw)


def test_the_window_undo_refuses_a_module_without_its_interface():
    with pytest.raises(TypeError, match="Linear has no forward_state"):
        WindowUndo().register(nn.Linear(2, 2))


def test_short_final_window_is_scaled_by_its_real_size(tmp_path, capsys):
    """The script's own loop: --debug's 256 digits in batches of 32 make 8 micro-batches an epoch,
    windows of A=3: 3, 3, 2. The short window's gradient is the plain mean over its 2 micro-batches
    (each scaled by 1/2, not 1/3), as one batch of 64 gives it."""
    args = ["--debug", "--device", "cpu", "--arch", "lenet", "--no-augment", "--batch-size", "32", "--accum-steps", "3",
            "--epochs", "1", "--lr", "0.1", "--lr-schedule", "constant", "--out", str(tmp_path / "run")]
    with StepRecorder("LeNet") as recorded:
        assert_ok(in_process(train_classifier.main, args, capsys))
    assert [seen for _, _, seen in recorded.steps] == [3, 6, 8]
    weights, grads, _ = recorded.steps[2]
    images = torch.cat(recorded.inputs[6:8])  # the short window's two micro-batches
    torch.manual_seed(0)
    reference = build_model("lenet", 10, 32)
    with torch.no_grad():
        for param, value in zip(reference.parameters(), weights):
            param.copy_(value)
    digits = DigitsDataset(train=True)
    targets = _targets_of(images, digits)
    reference.train()
    nn.functional.cross_entropy(reference(images), targets).backward()
    for ours, theirs in zip(grads, (p.grad for p in reference.parameters())):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _targets_of(images: torch.Tensor, digits) -> torch.Tensor:
    """The labels of these (un-augmented, normalised) digits, found by their pixels."""
    from ddp_utils.data.sets import DIGITS_MEAN, DIGITS_STD

    stored = (digits.images.expand(-1, 3, -1, -1) - DIGITS_MEAN[0]) / DIGITS_STD[0]  # N x 3 x 32 x 32
    distances = torch.cdist(images.flatten(1), stored.flatten(1))
    return digits.targets[distances.argmin(1)]


class _CountingScaler(torch.amp.GradScaler):
    calls: dict[str, int] = {}

    def unscale_(self, optimizer):
        _CountingScaler.calls["unscale_"] = _CountingScaler.calls.get("unscale_", 0) + 1
        return super().unscale_(optimizer)

    def update(self, new_scale=None):
        _CountingScaler.calls["update"] = _CountingScaler.calls.get("update", 0) + 1
        return super().update(new_scale)


def test_fp16_scaler_and_clipping_run_only_in_the_optimizer_step(tmp_path, capsys, monkeypatch):
    """The script's own loop with --amp fp16 --clip-grad 1 --accum-steps 4 (windows 4, 4): the
    gradients add up, still scaled, through a window; unscaled, clipped and stepped once per
    window, on the unscaled gradients (no GradScaler.step)."""
    monkeypatch.setattr(torch.amp, "GradScaler", _CountingScaler)
    _CountingScaler.calls = {}
    args = ["--debug", "--device", "cpu", "--arch", "lenet", "--image-size", "16", "--amp", "fp16", "--clip-grad", "1",
            "--batch-size", "32", "--accum-steps", "4", "--epochs", "1", "--out", str(tmp_path / "run")]
    grads_seen = []
    from torch.nn.modules.module import register_module_forward_pre_hook

    def before_forward(module, args):
        if type(module).__name__ == "LeNet" and module.training:
            grads_seen.append(all(p.grad is not None for p in module.parameters()))

    handle = register_module_forward_pre_hook(before_forward)
    clips = []
    real_clip = nn.utils.clip_grad_norm_
    monkeypatch.setattr(nn.utils, "clip_grad_norm_", lambda *a, **k: clips.append(1) or real_clip(*a, **k))
    try:
        with StepRecorder("LeNet") as recorded:
            assert_ok(in_process(train_classifier.main, args, capsys))
    finally:
        handle.remove()
    assert grads_seen == [False, True, True, True] * 2  # freed by each step, kept within a window
    assert _CountingScaler.calls == {"unscale_": 2, "update": 2} and len(clips) == 2 and len(recorded.steps) == 2


def test_an_fp16_overflow_skips_the_step_and_lowers_the_scale():
    """The scripts' step on plain objects: a window whose scaled gradients overflow is told by
    fp16_overflow and the agreement (no other host read), may not step, and the scaler's
    update halves the scale."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 4)
    window_loss = torch.zeros(())
    for scale in (1.0, 1e36):  # the 2nd micro-batch's loss is finite (about 1e36), x 1024 it overflows
        loss = model(x).sum() * scale
        scaler.scale(loss / 2).backward()
        window_loss = window_loss + loss.detach() / 2
    scaler.unscale_(optimizer)
    overflow = fp16_overflow(scaler, optimizer, grad_norm=None)
    verdict = StepGuard(None, torch.device("cpu"))(~torch.isfinite(window_loss), overflow)
    assert verdict.overflow and not verdict.nonfinite_ranks and not verdict.may_step
    if verdict.may_step:
        optimizer.step()
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved
    assert scaler.get_scale() == 2.0**9  # halved by update()


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
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_micro, grad_storage, stepped = [], [], []
    batches = [(torch.randn(8, 32), torch.randint(4, (8,))) for _ in range(accum_steps * optimizer_steps)]
    _micro_steps(model, optimizer, batches, accum_steps, before_forward=lambda: (
        per_micro.append(dict(calls)),
        grad_storage.append(tuple(None if p.grad is None else p.grad.data_ptr() for p in model.parameters()))),
        after_step=lambda: stepped.append(len(per_micro)))
    per_micro.append(dict(calls))
    per_step = []
    for i, (before, after) in enumerate(zip(per_micro, per_micro[1:])):
        if i + 1 not in stepped:
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
    marks = []
    _micro_steps(model, torch.optim.SGD(model.parameters(), lr=0.1),
                 [(torch.randn(4, 8), torch.randint(4, (4,)))] * (accum_steps * optimizer_steps), accum_steps,
                 before_forward=lambda: marks.append(calls["n"]))
    marks.append(calls["n"])
    return [b - a for a, b in zip(marks, marks[1:])]


def _micro_steps(model, optimizer, batches, accum_steps: int, before_forward, after_step=lambda: None):
    """Plain objects through the mechanics, as train_one_epoch drives them: no_sync on all but a
    window's last micro-step, the scaled loss's backward, after the last the step as the scripts
    write it (with the real agreement: one all_reduce)."""
    guard, window_loss = StepGuard(None, torch.device("cpu")), 0.0
    for micro, (x, y) in zip(plan_windows(len(batches), accum_steps), batches):
        before_forward()
        with no_sync(model, enabled=not micro.is_last):
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / micro.window_size).backward()
        window_loss = window_loss + loss.detach() / micro.window_size
        if micro.is_last:
            overflow = fp16_overflow(torch.amp.GradScaler("cpu", enabled=False), optimizer, grad_norm=None)
            verdict = guard(~torch.isfinite(window_loss), overflow)
            set_lr(optimizer, 0.1)
            if verdict.may_step:
                optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # in place, as under DDP
            after_step()
            window_loss = 0.0


def test_the_stop_agreement_is_one_all_reduce_per_optimizer_step(communication):
    """Signals, Ctrl-C and non-finite losses travel in one collective, on a window's last
    micro-step only (DDP's gradient all-reduce runs in C++ and is not counted here)."""
    for rank in communication:
        assert rank["agreements"] == [0, 0, 1, 0, 0, 1]
