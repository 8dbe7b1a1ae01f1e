"""MoCo: shared queue, momentum encoder, shuffle BN, accumulation, memory, learning, resume,
linear probe and backbone export. Distributed checks run the real setup() and training loop of
train_moco.py on 2 gloo ranks."""
from __future__ import annotations

import contextlib
import gc
import json

import pytest
import torch
import torchvision
from helpers import (
    MOCO_REF,
    assert_ok,
    assert_same_state,
    in_process,
    load_ckpt,
    read_scalars,
    resume_folder,
    run_cli,
    run_on_ranks,
    run_ranks,
)
from memory_probe import SavedTensorMeter
from torch import nn

import ddp_utils.models.moco as moco_module
import train_moco
from ddp_utils.models.backbones import build_model
from ddp_utils.models.moco import MoCo, contrastive_loss, info_nce
from ddp_utils.models.shuffle_bn import (
    SplitBatchNorm2d,
    gather_unshuffled,
    plan_shuffle,
    shuffle_permutation,
    shuffle_to_ranks,
)
from ddp_utils.runtime.dist import DistInfo
from ddp_utils.train.pretrained import export_backbone
from ddp_utils.train.run import start_training
from ddp_utils.train.session import RunSession

TINY = dict(dataset="digits", arch="small_cnn", image_size=16, batch_size=8, moco_k=40, device="cpu",
            knn_every=0, log_every=1000, epochs=1)


@contextlib.contextmanager
def _run(tmp_dir: str, **overrides):
    """The script's own run (setup under a RunSession) and its step meter, on this process's ranks."""
    cfg = train_moco.MocoConfig(**{**TINY, "out": tmp_dir, **overrides})
    with RunSession(cfg) as session:
        run = train_moco.setup(cfg, session)
        yield run, start_training(run)


def _train(run: train_moco.MocoRun, meter, max_steps: int) -> None:
    run.cfg.max_steps = max_steps
    train_moco.train_one_epoch(run, meter)


# ----------------------------------------------------------------------------- 2-rank checks
def _queue_worker(info: DistInfo, tmp_dir: str):
    with _run(tmp_dir, accum_steps=2, moco_m=0.9) as (run, meter):
        return _queue_checks(run, meter)


def _queue_checks(run, meter):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    moco = run.moco
    traffic = {"bytes": 0}

    def counting_hook(state, bucket):
        traffic["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    run.network.register_comm_hook(None, counting_hook)
    updates = []
    original_update = moco.momentum_update

    def counting_update(m):
        updates.append((m, [p.clone() for p in moco.encoder_k.parameters()]))
        original_update(m)

    moco.momentum_update = counting_update
    enqueued = []
    original_enqueue = moco.enqueue

    def recording_enqueue(k):
        enqueued.append((k.requires_grad, k.grad_fn is None, k.shape[0]))
        original_enqueue(k)

    moco.enqueue = recording_enqueue
    k_before = [p.clone() for p in moco.encoder_k.parameters()]
    _train(run, meter, max_steps=1)
    q_after_1 = [p.detach().clone() for p in moco.encoder_q.parameters()]
    k_after_1 = [p.clone() for p in moco.encoder_k.parameters()]
    _train(run, meter, max_steps=3)
    grad_bytes = sum(p.numel() * p.element_size() for p in moco.encoder_q.parameters())
    return {
        "queue": moco.queue.clone(), "ptr": int(moco.queue_ptr), "queue_grad": moco.queue.requires_grad,
        "queue_fn": moco.queue.grad_fn, "enqueued": enqueued, "updates": len(updates),
        "k_before": k_before, "q_after_1": q_after_1, "k_after_1": k_after_1,
        "k_grads": [p.grad for p in moco.encoder_k.parameters()],
        "k_requires_grad": [p.requires_grad for p in moco.encoder_k.parameters()],
        "k_final": [p.clone() for p in moco.encoder_k.parameters()],
        "bytes_per_step": traffic["bytes"] / 3, "grad_bytes": grad_bytes,
        "k_in_optimizer": any(p is kp for g in run.optimizer.param_groups for p in g["params"]
                              for kp in moco.encoder_k.parameters()),
    }


def _two_ranks_worker(info: DistInfo, tmp_dir: str) -> dict:
    """Both 2-rank scenarios in one job: the shuffle round trip, then the real training loop."""
    return {"shuffle": _shuffle_worker(info, tmp_dir), "queue": _queue_worker(info, tmp_dir + "/run")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("two_ranks")
    return run_on_ranks(_two_ranks_worker, tmp, str(tmp))


def test_queue_momentum_encoder_and_accumulation_on_two_ranks(two_ranks):
    r0, r1 = (rank["queue"] for rank in two_ranks)
    # 1. Queue identical on both ranks; pointer advanced by global batch x micro-steps mod K.
    assert torch.equal(r0["queue"], r1["queue"])
    assert r0["ptr"] == r1["ptr"] == (2 * 8 * 2 * 3) % 40 == 16  # wrapped around K=40 twice
    assert not r0["queue_grad"] and r0["queue_fn"] is None
    # One enqueue per optimizer step, of the whole window's keys: 2 micro-steps x 2 ranks x 8,
    # already gathered (the shuffle BN gather delivered every rank's keys), without a graph.
    assert [(False, True, 2 * 2 * 8)] * 3 == r0["enqueued"]
    assert torch.allclose(r0["queue"].norm(dim=0), torch.ones(40), atol=1e-5)  # unit keys
    # 2. encoder_k: no gradient, not optimised, identical on both ranks, and after the first
    #    optimizer step exactly m*k_old + (1-m)*q_new.
    assert all(g is None for g in r0["k_grads"]) and not any(r0["k_requires_grad"])
    assert not r0["k_in_optimizer"]
    for a, b in zip(r0["k_final"], r1["k_final"]):
        assert torch.equal(a, b)
    m = 0.9
    moved = 0.0
    for k_old, q_new, k_new in zip(r0["k_before"], r0["q_after_1"], r0["k_after_1"]):
        torch.testing.assert_close(k_new, m * k_old + (1 - m) * q_new, rtol=1e-6, atol=1e-7)
        moved = max(moved, (k_new - k_old).abs().max().item())
    assert moved > 0
    # 3. A=2: one momentum update and one all-reduce round per optimizer step (3 steps, 6 micro).
    assert r0["updates"] == r1["updates"] == 3
    assert r0["bytes_per_step"] == r0["grad_bytes"]


def _shuffle_worker(info: DistInfo, tmp_dir: str):
    torch.manual_seed(info.rank)  # different local RNGs: they must not matter
    x = (info.rank * 6 + torch.arange(6, dtype=torch.float32)).unsqueeze(1).repeat(1, 4)  # 6 x 4
    plan = plan_shuffle(shuffle_permutation(0, 0, 12), info.rank, 2, x.device)
    shuffled = shuffle_to_ranks(x, plan)
    restored = gather_unshuffled(shuffled, plan)[info.rank * 6:(info.rank + 1) * 6]
    images = torch.randn(6, 3, 4, 5)  # as a CUDA batch arrives: channels_last
    nchw, nhwc = shuffle_to_ranks(images, plan), shuffle_to_ranks(images.contiguous(memory_format=torch.channels_last), plan)
    return {"x": x, "shuffled": shuffled, "restored": restored, "images_equal": torch.equal(nchw, nhwc),
            "stays_channels_last": nhwc.is_contiguous(memory_format=torch.channels_last)}


def test_shuffle_and_unshuffle_return_every_sample_home(two_ranks):
    r0, r1 = (rank["shuffle"] for rank in two_ranks)
    for r in (r0, r1):
        assert torch.equal(r["restored"], r["x"])
    ids = torch.cat([r0["shuffled"][:, 0], r1["shuffled"][:, 0]])
    assert sorted(ids.tolist()) == list(range(12))  # a permutation of the global batch...
    assert ids.tolist() != list(range(12))  # ...that really moved samples (fixed seeds: it does)
    # channels_last images arrive channels_last (no re-lay before the key encoder), same values
    assert all(r["images_equal"] and r["stays_channels_last"] for r in (r0, r1))


# ----------------------------------------------------------------------------- one process
def test_split_batchnorm_normalises_each_group_on_its_own():
    torch.manual_seed(0)
    x = torch.randn(16, 3, 4, 4) * 3 + 1
    split = SplitBatchNorm2d(3, num_splits=4)
    out = split(x)
    for j in range(4):
        group = x[j::4]
        ref = nn.functional.batch_norm(group, None, None, training=True, eps=split.eps)
        torch.testing.assert_close(out[j::4], ref, rtol=1e-5, atol=1e-5)
    expected_mean = 0.1 * torch.stack([x[j::4].mean(dim=(0, 2, 3)) for j in range(4)]).mean(0)
    torch.testing.assert_close(split.running_mean, expected_mean)
    expected_var = 0.9 + 0.1 * torch.stack([x[j::4].var(dim=(0, 2, 3)) for j in range(4)]).mean(0)  # unbiased
    torch.testing.assert_close(split.running_var, expected_var)


def test_split_batchnorm_keeps_channels_last():
    """A channels_last input gives a channels_last output (else every following convolution
    converts the layout back), with the NCHW input's values, gradients and running statistics
    (two implementations: NCHW reshapes the groups into channels, channels_last cannot)."""
    torch.manual_seed(0)
    x = torch.randn(8, 5, 6, 6) * 2 + 1
    results = []
    for layout in (torch.contiguous_format, torch.channels_last):
        split = SplitBatchNorm2d(5, num_splits=2)
        torch.manual_seed(1)
        nn.init.uniform_(split.weight), nn.init.uniform_(split.bias)
        xi = x.clone().to(memory_format=layout).requires_grad_()
        out = split(xi)
        assert out.is_contiguous(memory_format=layout)
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        results.append((out, xi.grad, split.weight.grad, split.running_mean, split.running_var))
    for nchw, channels_last in zip(*results):
        torch.testing.assert_close(channels_last, nchw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_split_batchnorm_under_bf16_autocast_normalises_in_fp32(layout):
    """A bf16 activation (a convolution's output under autocast): bf16 out, statistics from fp32
    arithmetic, fp32 running statistics; the same as plain BatchNorm on each group."""
    torch.manual_seed(0)
    x = (torch.randn(8, 5, 6, 6) * 3 + 2).bfloat16().contiguous(memory_format=layout)
    split = SplitBatchNorm2d(5, num_splits=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = split(x)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=layout)
    assert split.running_mean.dtype == split.running_var.dtype == torch.float32
    for j in range(2):
        group = x[j::2].float()
        ref = nn.functional.batch_norm(group, None, None, training=True, eps=split.eps)
        torch.testing.assert_close(out[j::2].float(), ref, rtol=0, atol=2e-2)  # bf16 output rounding
    expected_mean = 0.1 * torch.stack([x[j::2].float().mean(dim=(0, 2, 3)) for j in range(2)]).mean(0)
    torch.testing.assert_close(split.running_mean, expected_mean)


def _graph_bytes_after_steps(run, step_meter) -> list[int]:
    """Bytes autograd still holds for a backward after 2, 4, ... 10 optimizer steps."""
    meter, held = SavedTensorMeter(), []
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        for steps in (2, 4, 6, 8, 10):
            _train(run, step_meter, max_steps=steps)
            gc.collect()
            held.append(meter.live)
    return held


def test_no_graph_outlives_its_step_and_no_autograd_errors(tmp_path, monkeypatch):
    """10 steps under anomaly detection: no autograd error, and after every step nothing is
    left of any graph (every tensor saved for backward counted, tests/memory_probe.py). The
    negative control is the classic hack: keep each step's logits and back-propagate with
    retain_graph=True (what people add to silence "backward through the graph a second time"):
    every step's graph then stays alive and what autograd holds climbs step after step."""
    torch.autograd.set_detect_anomaly(True)
    try:
        with _run(str(tmp_path / "a"), batch_size=32, bn_splits=4, moco_k=256, image_size=32) as run_meter:
            ours = _graph_bytes_after_steps(*run_meter)
        kept = []
        real_loss = moco_module.contrastive_loss

        def leaky_loss(logits):
            kept.append(logits)  # the classic mistake: a graph-carrying tensor outlives its step
            return real_loss(logits)

        real_backward = torch.Tensor.backward
        monkeypatch.setattr(moco_module, "contrastive_loss", leaky_loss)
        monkeypatch.setattr(torch.Tensor, "backward",
                            lambda self, *a, **kw: real_backward(self, *a, **{**kw, "retain_graph": True}))
        with _run(str(tmp_path / "b"), batch_size=32, bn_splits=4, moco_k=256, image_size=32) as run_meter:
            leaky = _graph_bytes_after_steps(*run_meter)
    finally:
        torch.autograd.set_detect_anomaly(False)
    assert ours == [0] * 5
    growth = [after - before for before, after in zip(leaky, leaky[1:])]  # per 2 steps
    assert len(set(growth)) == 1 and growth[0] > 16 * 2**20, leaky  # 2 more graphs kept, every time


def test_debug_cli_runs_under_anomaly_detection_with_accumulation(tmp_path, capsys):
    proc = in_process(train_moco.main, ["--debug", "--device", "cpu", "--arch", "small_cnn", "--image-size", "16",
                                        "--batch-size", "16", "--accum-steps", "2", "--moco-k", "128",
                                        "--epochs", "2", "--knn-k", "20", "--out", str(tmp_path / "d")], capsys)
    assert_ok(proc)
    assert "anomaly detection on" in proc.stdout
    ckpt = load_ckpt(tmp_path / "d/checkpoint_last.pt")
    assert ckpt["step"] == 2 * 8 and int(ckpt["model"]["queue_ptr"]) == (2 * 16 * 16) % 128


# ----------------------------------------------------------------------------- the bare command
# Percentage points, below the gain of every run measured of the bare command (docs/moco.md):
# 77.16% at step 0 -> 86 to 89% at the end, in one process and on 2 and 4 ranks.
KNN_MARGIN = 5.0


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_bare_command_learns_digits_features(ranks, tmp_path):
    """``train_moco.py --out DIR`` and nothing else, the real CLI (torchrun for 2 ranks): the
    embedded digits with their own defaults, a final kNN accuracy KNN_MARGIN points above the
    step-0 one, and not one warning."""
    out = tmp_path / "run"
    threads = {"OMP_NUM_THREADS": "2"} if ranks == 1 else None  # as a plain `python` run on 2 cores
    proc = run_cli("train_moco.py", ["--out", str(out)], nproc=ranks, timeout=600, env=threads)
    assert_ok(proc)
    assert "WARNING" not in proc.stdout and "warning" not in proc.stderr.lower(), proc.stdout + proc.stderr
    scalars = read_scalars(out / "tb")
    for tag in ("train/loss", "train/contrastive_acc1", "train/lr", "train/moco_m", "train/images_per_sec"):
        assert scalars.get(tag), tag
    knn, steps = scalars["knn/acc1"], 15 * 44 // ranks  # 15 epochs of 1,438 images in global batches of 32 x ranks
    assert [step for step, _ in knn] == [0, steps // 3, 2 * steps // 3, steps]  # every 5 epochs
    start, end = knn[0][1], knn[-1][1]
    assert end >= start + KNN_MARGIN, knn
    assert f"final kNN acc1 {end:.2f}% at step {steps}" in proc.stdout  # the run's one-line summary
    record = json.loads((out / "config.json").read_text())
    assert record["resolved"]["dataset_defaults"] == train_moco.DATASET_DEFAULTS["digits"]


def test_resume_restores_queue_pointer_and_key_encoder_exactly(moco_reference, tmp_path):
    """Step 9's checkpoint resumed on 2 ranks to step 30, across the end of epoch 1: encoders,
    queue, its pointer, the shuffle count and the momentum schedule equal the reference's."""
    part = resume_folder(moco_reference.checkpoint(9), tmp_path / "part")
    assert_ok(run_ranks("train_moco.py", MOCO_REF + ["--resume", "auto", "--out", str(part)], tmp_path))
    ref, res = moco_reference.final, load_ckpt(part / "checkpoint_last.pt")
    assert ref["step"] == 30 and ref["epoch"] == 1
    assert_same_state(res, ref)  # queue, ptr, shuffle count, encoders, optimizer
    assert int(res["model"]["queue_ptr"]) == (30 * 2 * 2 * 16) % 200
    ref_m = read_scalars(moco_reference.out / "tb")["train/moco_m"]
    res_m = dict(read_scalars(part / "tb")["train/moco_m"])
    assert sorted(res_m) == list(range(10, 31)) and all(res_m[step] == m for step, m in ref_m if step > 9)


@pytest.mark.slow  # a 2-rank job; test_linear_probe_with_mocos_protocol keeps the probe in the fast tier
def test_linear_probe_from_moco_checkpoint_keeps_backbone(trained_moco, tmp_path):
    probe_out = tmp_path / "probe"
    proc = run_ranks("train_classifier.py", ["--device", "cpu", "--image-size", "16", "--pretrained",
                                             str(trained_moco / "run/checkpoint_last.pt"), "--linear-probe",
                                             "--probe-bn", "--lr", "0.1", "--weight-decay", "0", "--epochs", "3",
                                             "--out", str(probe_out)], tmp_path)
    assert_ok(proc)
    assert "frozen backbone unchanged" in proc.stdout
    moco_state = load_ckpt(trained_moco / "run/checkpoint_last.pt")["model"]
    probe_state = load_ckpt(probe_out / "checkpoint_last.pt")["model"]
    backbone = {k: v for k, v in probe_state.items() if k.startswith("backbone.")}
    assert backbone and len(backbone) == sum(k.startswith("encoder_q.backbone.") for k in moco_state)
    for key, value in backbone.items():  # weights and BatchNorm statistics, bit for bit
        assert torch.equal(value, moco_state["encoder_q." + key]), key
    acc = read_scalars(probe_out / "tb")["val/acc1"]
    # chance is 10%; 5 MoCo steps leave the features close to random ones (measured: 38.7%)
    assert len(acc) == 3 and acc[-1][1] > 30.0


def test_linear_probe_with_mocos_protocol(trained_moco, tmp_path, capsys):
    """MoCo's own protocol (no feature normalisation, LR 30, no weight decay) on the exported
    backbone: runs, logs its accuracy and leaves the backbone untouched."""
    import train_classifier

    proc = in_process(train_classifier.main, ["--device", "cpu", "--image-size", "16", "--pretrained",
                                              str(trained_moco / "backbone.pt"), "--linear-probe", "--lr", "30",
                                              "--weight-decay", "0", "--epochs", "1", "--out", str(tmp_path / "p")],
                      capsys)
    assert_ok(proc)
    assert "frozen backbone unchanged" in proc.stdout
    assert len(read_scalars(tmp_path / "p/tb")["val/acc1"]) == 1


def test_exported_backbone_loads_into_torchvision_resnet(tmp_path):
    """What --export-backbone writes of a ResNet-18 MoCo (built as train_moco builds it) is
    torchvision's layout: only fc is missing."""
    cfg = train_moco.MocoConfig(arch="resnet18", device="cpu", moco_k=64, out=str(tmp_path / "r"))
    info = DistInfo(0, 0, 1, 1, torch.device("cpu"), None, "single")
    moco = train_moco.build_moco(cfg, info, num_classes=10, image_size=32)
    state = torch.load(export_backbone(moco.encoder_q.backbone, tmp_path / "backbone.pt"), weights_only=True)
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)  # the CIFAR stem used for 32 px inputs
    model.maxpool = nn.Identity()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) == {"fc.weight", "fc.bias"} and not unexpected
    # And the same backbone at ImageNet size has exactly torchvision's stock layout.
    stock = build_model("resnet18", 10, 224)
    stock.fc = nn.Identity()
    missing, unexpected = torchvision.models.resnet18().load_state_dict(stock.state_dict(), strict=False)
    assert set(missing) == {"fc.weight", "fc.bias"} and not unexpected


@pytest.mark.parametrize("args, message", [
    (["--moco-k", "16", "--batch-size", "32"], "--moco-k 16 is smaller than the global batch"),
    (["--moco-k", "48", "--batch-size", "32", "--accum-steps", "2"], "accum steps 2 x batch 32 = 64"),
    (["--batch-size", "31"], "must be a multiple of --bn-splits 2"),
    (["--moco-m", "1.0"], "--moco-m must be in [0, 1)"),
    (["--preset", "v3"], "invalid choice: 'v3'"),
    (["--knn-every", "-1"], "--knn-every must be >= 0"),
])
def test_moco_bad_input(tmp_path, capsys, args, message):
    try:
        code = train_moco.main(args + ["--device", "cpu", "--out", str(tmp_path / "r")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "r").exists()


def test_deterministic_changes_nothing_on_the_cpu(tmp_path, capsys):
    """--deterministic turns on torch.use_deterministic_algorithms (CUDA: also cuDNN's switches and
    no TF32). The CPU's kernels are deterministic already: the run, its kNN monitor included, is
    bit for bit the plain one, and the mode is off again after the run."""
    args = ["--device", "cpu", "--dataset", "digits", "--arch", "small_cnn", "--image-size", "16", "--batch-size",
            "32", "--moco-k", "128", "--max-steps", "3", "--knn-every", "1", "--log-every", "1"]
    runs = []
    for name, extra in (("plain", []), ("deterministic", ["--deterministic"])):
        proc = in_process(train_moco.main, args + extra + ["--out", str(tmp_path / name)], capsys)
        assert_ok(proc)
        assert not torch.are_deterministic_algorithms_enabled()
        runs.append((load_ckpt(tmp_path / name / "checkpoint_last.pt"),
                     [line.split("kNN acc1 ")[1].split(" in ")[0] for line in proc.stdout.splitlines()
                      if "kNN acc1" in line]))
    (plain, plain_knn), (deterministic, deterministic_knn) = runs
    assert plain_knn and plain_knn == deterministic_knn
    assert deterministic["config"]["deterministic"] and not plain["config"]["deterministic"]
    assert_same_state(deterministic, plain)


def test_presets_are_defaults_that_flags_override():
    from ddp_utils.config import parse_config

    v1 = parse_config(train_moco.MocoConfig, ["--preset", "v1", "--epochs", "200"])
    assert (v1.moco_t, v1.mlp, v1.lr_schedule, v1.lr_milestones, v1.aug) == (0.07, False, "step", "60%,80%", "v1")
    assert v1.milestone_steps(10) == [1200, 1600]  # epochs 120 and 160 of 200
    v2 = parse_config(train_moco.MocoConfig, ["--moco-t", "0.5"])
    assert (v2.preset, v2.moco_t, v2.mlp, v2.lr_schedule, v2.aug) == ("v2", 0.5, True, "cosine", "v2")


def test_sync_bn_on_cpu_with_several_processes_is_refused(tmp_path, capsys, monkeypatch):
    """As rank 0 of 2 (torchrun's variables): one line, exit 2, before any process group forms."""
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    proc = in_process(train_moco.main, ["--device", "cpu", "--sync-bn", "--out", str(tmp_path / "r")], capsys)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--sync-bn needs CUDA" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_info_nce_logits_are_fp32_under_bf16_autocast():
    """A bf16 matmul would round each similarity to 8 bits before the division by T = 0.07."""
    torch.manual_seed(0)
    q, k = nn.functional.normalize(torch.randn(6, 16), dim=1), nn.functional.normalize(torch.randn(6, 16), dim=1)
    negatives = nn.functional.normalize(torch.randn(16, 32), dim=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = info_nce(q.bfloat16(), k.bfloat16(), negatives, T=0.07)
    assert logits.dtype == torch.float32
    expected = info_nce(q.bfloat16().float(), k.bfloat16().float(), negatives, T=0.07)
    assert torch.equal(logits, expected)


def test_bf16_autocast_keys_enter_the_fp32_queue_exactly(tmp_path, capsys):
    """Under bf16 autocast the key encoder yields bf16 keys; the queue keeps fp32 columns that
    are exactly those keys, and the loss of a step is finite. Then the whole bf16 CLI path."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                            nn.Linear(4, 8))
    moco = MoCo(encoder, dim=8, K=24, shuffle_bn=False)
    im_q, im_k = torch.randn(6, 3, 5, 5), torch.randn(6, 3, 5, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, keys = moco(im_q, im_k)
        loss, _ = contrastive_loss(logits)
    moco.enqueue(keys)
    assert keys.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert torch.equal(moco.queue[:, :6], keys.T.float()) and moco.queue_position == int(moco.queue_ptr) == 6
    out = tmp_path / "bf16"
    assert_ok(in_process(train_moco.main, ["--debug", "--device", "cpu", "--amp", "bf16", "--image-size", "16",
                                           "--batch-size", "16", "--moco-k", "64", "--max-steps", "3",
                                           "--knn-every", "0", "--out", str(out)], capsys))
    ckpt = load_ckpt(out / "checkpoint_last.pt")
    assert ckpt["config"]["amp"] == "bf16" and int(ckpt["model"]["queue_ptr"]) == (3 * 16) % 64
