"""The --dataset cifar10 path end to end, on a tiny CIFAR-10 folder in torchvision's own format
(tests/fake_cifar.py: 300 training and 101 test images made of scikit-learn's digits). Nothing can
be downloaded here, so only the md5 comparison with the real files is skipped, in the children only."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from fake_cifar import cifar_env, write_fake_cifar10
from helpers import REPO, assert_ok, cli_env, load_ckpt, read_scalars, run_cli, run_ranks

CPU = ["--device", "cpu"]
N_TRAIN, N_TEST = 300, 101  # 30 train and 10 test images per class, +1 test image: 101 splits 51/50 on 2 ranks
WORLD, BATCH = 2, 16
STEPS_PER_EPOCH = N_TRAIN // WORLD // BATCH  # 150 images per rank: 9 full batches of 16
# Chance is 10%. Measured on 2 ranks: the classifier (--aug-on device) val acc1 70.30% after
# epoch 1 -> 97.03% after epoch 2; MoCo kNN acc1 75.25% at step 0 (the class colours alone)
# -> 79.21% (--aug-on loader) / 84.16% (device) at step 9.
MIN_VAL_ACC, MIN_KNN_ACC = 50.0, 40.0
FINAL_KNN = re.compile(r"final kNN acc1 ([\d.]+)% at step (\d+)")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_cifar")
    counts = write_fake_cifar10(root / "data", train_per_class=30, test_per_class=10, test_extra=1)
    assert counts == {"train": N_TRAIN, "test": N_TEST}
    return SimpleNamespace(data=root / "data", env=cifar_env(root / "site"))


def assert_fraction_of(acc: float, n: int) -> None:
    """``acc`` (percent) is k / n for a whole number k: every one of the n images counted once."""
    k = acc * n / 100
    assert abs(k - round(k)) < 1e-3, f"{acc}% is no whole number of images out of {n}"


def cifar_args(cifar, out, *extra: str) -> list[str]:
    return CPU + ["--dataset", "cifar10", "--data-dir", str(cifar.data), "--arch", "small_cnn",
                  *extra, "--out", str(out)]


def check_config(out, aug_on: str) -> None:
    """The run recorded CIFAR-10 and where it augmented."""
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["dataset"] == "cifar10" and config["world_size"] == WORLD
    assert config["config"]["aug_on"] == aug_on


# ----------------------------------------------------------------------------- the md5 bypass
@pytest.mark.slow  # two runs; the bypass itself is checked in the fast tier below
def test_fake_cifar_needs_the_bypass_and_then_trains_in_one_process(tmp_path, cifar):
    # the per-sample loader path: PIL images through torchvision's transforms in the DataLoader
    args = cifar_args(cifar, tmp_path / "run", "--batch-size", "32", "--epochs", "1", "--aug-on", "loader")
    refused = run_cli("train_classifier.py", args)
    # torchvision's md5 check refuses the fake files: one line naming the folder and the fix, exit 2
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert refused.stderr.count("\n") == 1 and "cifar-10-batches-py/ is incomplete or damaged" in refused.stderr
    assert "Dataset not found or corrupted" in refused.stderr and "--download" in refused.stderr
    assert not (tmp_path / "run" / "checkpoint_last.pt").exists()

    proc = run_cli("train_classifier.py", args, env=cifar.env)
    assert_ok(proc)
    assert load_ckpt(tmp_path / "run" / "checkpoint_last.pt")["step"] == N_TRAIN // 32 == 9
    assert re.findall(r"\((\d+) images\)", proc.stdout) == [str(N_TEST)]
    (step, acc), = read_scalars(tmp_path / "run" / "tb")["val/acc1"]
    assert step == 9 and acc >= 30.0  # measured 75.25% after this one epoch
    assert_fraction_of(acc, N_TEST)


def test_bypass_skips_only_cifar10s_md5(tmp_path, cifar):
    """In a child with the bypass: the fake files load, but a CIFAR-10 folder with a file missing
    is still refused, and CIFAR-100 (a subclass of CIFAR10) still has its md5s checked."""
    broken = tmp_path / "broken"
    shutil.copytree(cifar.data, broken)
    (broken / "cifar-10-batches-py" / "data_batch_3").unlink()
    c100 = tmp_path / "c100" / "cifar-100-python"
    c100.mkdir(parents=True)
    for name in ("train", "test", "meta"):
        (c100 / name).write_bytes(b"not CIFAR-100")
    code = textwrap.dedent("""\
        import json, sys
        from torchvision.datasets import CIFAR10, CIFAR100

        def outcome(make):
            try:
                return len(make())
            except RuntimeError:
                return "refused"

        good, broken, c100 = sys.argv[1:]
        print(json.dumps({"train": outcome(lambda: CIFAR10(good)), "test": outcome(lambda: CIFAR10(good, train=False)),
                          "broken": outcome(lambda: CIFAR10(broken)), "cifar100": outcome(lambda: CIFAR100(c100)),
                          "patched": getattr(CIFAR10, "FAKE_CIFAR_MD5_BYPASS", False)}))
        """)
    child = subprocess.run([sys.executable, "-c", code, str(cifar.data), str(broken), str(c100.parent)],
                           cwd=REPO, env=cli_env(cifar.env), capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.splitlines()[-1]) == {
        "train": N_TRAIN, "test": N_TEST, "broken": "refused", "cifar100": "refused", "patched": True}
    from torchvision.datasets import CIFAR10  # this (the parent) process is left alone

    assert not hasattr(CIFAR10, "FAKE_CIFAR_MD5_BYPASS")


# ----------------------------------------------------------------------------- real CLIs
@pytest.mark.slow
def test_classifier_learns_fake_cifar_on_two_ranks(tmp_path, cifar):
    """The device path (the loader path is the one-process run above): uint8 images held on the
    device, padded crops and flips as a batch."""
    aug_on = "device"
    out, aug_flags = tmp_path / "run", ["--aug-on", aug_on]
    proc = run_ranks("tests/fake_cifar.py", ["train_classifier.py", *cifar_args(
        cifar, out, "--batch-size", str(BATCH), "--epochs", "2", *aug_flags)], tmp_path, nproc=WORLD)
    assert_ok(proc)
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 2 * STEPS_PER_EPOCH
    check_config(out, aug_on)
    # Each evaluation counts the whole test split once (101 does not split evenly over 2 ranks).
    assert re.findall(r"\((\d+) images\)", proc.stdout) == [str(N_TEST)] * 2
    scalars = read_scalars(out / "tb")
    val = scalars["val/acc1"]
    assert [step for step, _ in val] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    for _, acc in val:
        assert_fraction_of(acc, N_TEST)
    top5 = scalars["val/acc5"]  # ImageNet's second number, counted the same way
    assert [step for step, _ in top5] == [step for step, _ in val]
    for (_, acc1), (_, acc5) in zip(val, top5):
        assert_fraction_of(acc5, N_TEST)
        assert acc1 <= acc5 <= 100.0
    final, final5 = val[-1][1], top5[-1][1]
    assert final >= MIN_VAL_ACC, val
    assert f"final val acc1 {final:.2f}%, acc5 {final5:.2f}% at step {2 * STEPS_PER_EPOCH}" in proc.stdout
    speed = scalars["train/images_per_sec"]
    assert speed and all(v > 0 for _, v in speed), speed
    total = 2 * STEPS_PER_EPOCH
    assert re.search(rf"step {total}/{total} .*\d img/s", proc.stdout), proc.stdout[-2000:]  # the progress line


def check_moco_run(proc, out, steps: int, world: int, batch: int, moco_k: int) -> None:
    """The one-line summary agrees with the checkpoint, its queue pointer and TensorBoard."""
    assert_ok(proc)
    (acc_text, step_text), = FINAL_KNN.findall(proc.stdout)
    step = int(step_text)
    ckpt = load_ckpt(out / "checkpoint_last.pt")
    assert step == ckpt["step"] == steps
    assert int(ckpt["model"]["queue_ptr"]) == (step * world * batch) % moco_k
    knn = read_scalars(out / "tb")["knn/acc1"]
    assert [s for s, _ in knn] == [0, step]
    for _, acc in knn:
        assert_fraction_of(acc, N_TEST)
    assert f"{knn[-1][1]:.2f}" == acc_text
    assert knn[-1][1] >= MIN_KNN_ACC, knn


@pytest.mark.slow
@pytest.mark.parametrize("aug_on", ["loader", "device"])
def test_moco_on_fake_cifar_on_two_ranks(tmp_path, cifar, aug_on):
    out, aug_flags = tmp_path / "moco", ["--aug-on", aug_on]
    proc = run_ranks("tests/fake_cifar.py", ["train_moco.py", *cifar_args(
        cifar, out, "--batch-size", str(BATCH), "--moco-k", "256", "--epochs", "1", "--knn-k", "20", *aug_flags)],
        tmp_path, nproc=WORLD)
    # 9 steps x 2 ranks x 16 = 288 keys: the pointer wrapped once, to 32
    check_moco_run(proc, out, STEPS_PER_EPOCH, WORLD, BATCH, 256)
    check_config(out, aug_on)
