"""Every user mistake: exit code 2, one line naming the fix, no traceback, nothing written into
--out, printed once (by rank 0) under torchrun. The "Bad input" table of docs/bad-input.md lists the
same (tests/test_docs.py keeps it equal to CASES)."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import REPO, cli_env, in_process, run_cli, write_image_folder

import train_classifier
import train_moco
from ddp_utils.config import UsageError

SCRIPTS = {"classifier": train_classifier, "moco": train_moco}
CONFIGS = {"classifier": train_classifier.ClassifierConfig, "moco": train_moco.MocoConfig}
FAST = ["--device", "cpu", "--knn-every", "0"]  # --knn-every is MoCo's; stripped for the classifier


class _Evil:
    """Unpickling this object would create a marker file: the code a hostile checkpoint runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def files(tmp_path_factory, trained_moco) -> dict[str, Path]:
    """Real checkpoints of both scripts and the broken inputs the cases point at."""
    root = tmp_path_factory.mktemp("inputs")
    common = ["--device", "cpu", "--max-steps", "1", "--batch-size", "16", "--image-size", "16"]
    assert train_classifier.main(common + ["--arch", "lenet", "--out", str(root / "cls")]) == 0
    (root / "corrupt.pt").write_bytes((root / "cls/checkpoint_last.pt").read_bytes()[:5000])
    torch.save({"model": _Evil(root / "PWNED")}, root / "evil.pt")
    (root / "a_file").write_text("not a folder\n")
    (root / "no_train").mkdir()
    write_image_folder(root / "empty_class", per_class=2)
    (root / "empty_class/train/class9").mkdir()
    write_image_folder(root / "three_classes", per_class=2)
    fixres = ["--dataset", "imagefolder", "--data-dir", str(root / "three_classes"), "--arch", "small_cnn",
              "--workers", "0", "--train-crop-size", "12"]
    assert train_classifier.main(common + fixres + ["--batch-size", "2", "--out", str(root / "fixres")]) == 0
    return {"fixres": root / "fixres/checkpoint_last.pt", "cls": root / "cls/checkpoint_last.pt", "moco": trained_moco / "run/checkpoint_last.pt",
            "corrupt": root / "corrupt.pt", "evil": root / "evil.pt", "marker": root / "PWNED",
            "a_file": root / "a_file", "no_train": root / "no_train", "empty_class": root / "empty_class",
            "cls_dir": root / "cls", "three_classes": root / "three_classes"}


# (script, arguments, what the one line must say); {name} is replaced by files[name].
CASES = [
    ("classifier", ["--batch-size", "0"], "--batch-size must be positive, got 0"),
    ("classifier", ["--batch-size", "-3"], "--batch-size must be positive, got -3"),
    ("classifier", ["--accum-steps", "0"], "--accum-steps must be positive"),
    ("classifier", ["--epochs", "0"], "--epochs must be positive"),
    ("classifier", ["--max-steps", "-5"], "--max-steps must be >= 0"),
    ("classifier", ["--lr", "0"], "--lr must be positive"),
    ("classifier", ["--lr", "-0.1"], "--lr must be positive"),
    ("classifier", ["--lr", "nan"], "argument --lr: nan is not a finite number"),
    ("classifier", ["--lr", "inf"], "argument --lr: inf is not a finite number"),
    ("classifier", ["--lr", "fast"], "argument --lr: invalid number 'fast'"),
    ("classifier", ["--momentum", "1"], "--momentum must be in [0, 1)"),
    ("classifier", ["--momentum=-inf"], "argument --momentum: -inf is not a finite number"),
    ("classifier", ["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    ("classifier", ["--weight-decay", "nan"], "argument --weight-decay/--wd: nan is not a finite number"),
    ("classifier", ["--clip-grad", "-1"], "--clip-grad must be >= 0"),
    ("classifier", ["--clip-grad", "inf"], "argument --clip-grad/--clip-grad-norm: inf is not a finite number"),
    ("classifier", ["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    ("classifier", ["--log-every", "0"], "--log-every must be positive"),
    ("classifier", ["--ckpt-every", "-1"], "--ckpt-every must be >= 0"),
    ("classifier", ["--keep-checkpoints", "0"], "--keep-checkpoints must be positive"),
    ("classifier", ["--skip-nonfinite", "-1"], "--skip-nonfinite must be >= 0"),
    ("classifier", ["--dist-timeout", "0"], "--dist-timeout must be positive, got 0.0"),
    ("classifier", ["--dist-timeout", "nan"], "argument --dist-timeout: nan is not a finite number"),
    ("classifier", ["--synthetic-samples", "0"], "--synthetic-samples must be positive"),
    ("classifier", ["--workers", "-2"], "--workers must be >= -1, got -2"),
    ("classifier", ["--image-size", "-1"], "--image-size must be >= 0"),
    ("classifier", ["--image-size", "8", "--arch", "lenet"], "--image-size 8 is too small for --arch lenet"),
    ("classifier", ["--image-size", "12", "--arch", "resnet18"], "give at least 16 px"),
    ("classifier", ["--dataset", "mnist"], "argument --dataset: invalid choice: 'mnist'"),
    ("classifier", ["--arch", "vgg"], "--arch vgg: not a model of this project or of torchvision; did you mean vgg19?"),
    ("classifier", ["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
    ("classifier", ["--batch-size", "ten"], "argument --batch-size/-b: invalid int value: 'ten'"),
    ("classifier", ["--lr-schedule", "step"], "--lr-schedule step needs --lr-milestones"),
    ("classifier", ["--lr-milestones", "a,b"], "give comma-separated epochs"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{no_train}"], "no 'train/' folder"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{empty_class}", "--image-size", "16"],
     "every class folder needs at least one image"),
    ("classifier", ["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "add --download"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "s3://bucket/imagenet"],
     "an object store holds shards only; write them with write_shards.py"),
    ("moco", ["--dataset", "shards", "--data-dir", "s3://KEY:SECRET@bucket/x"], "credentials do not belong in the address"),
    ("moco", ["--dataset", "shards", "--data-dir", "{three_classes}", "--shard-cache-gb", "4"],
     "--shard-cache-gb does nothing with --dataset shards"),
    ("moco", ["--dataset", "shards", "--data-dir", "s3://bucket/x", "--shard-cache-gb", "-1"],
     "--shard-cache-gb must be >= 0"),
    ("moco", ["--dataset", "shards", "--data-dir", "s3://bucket/x", "--store-timeout", "600"],
     "--store-timeout 600 leaves a rank waiting for the store longer than its peers wait in a collective"),
    ("moco", ["--dataset", "shards", "--data-dir", "s3://bucket/x", "--order", "samples"],
     "--order samples would read every shard of s3://bucket/x in every batch"),
    ("moco", ["--order", "shards"], "--order shards reads whole shards; --dataset digits has none"),
    ("moco", ["--dataset", "shards", "--data-dir", "{three_classes}", "--store-timeout", "60"],
     "--store-timeout does nothing with --dataset shards"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{three_classes}", "--aug-on", "loader", "--decode-on",
                    "device"], "--decode-on device needs --aug-on device"),
    ("classifier", ["--check-data"], "--check-data does nothing with --dataset digits"),
    ("classifier", ["--batch-size", "4096"], "too few for 1 rank(s) x batch 4096; lower --batch-size"),
    ("classifier", ["--resume", "/nonexistent/ckpt.pt"], "--resume /nonexistent/ckpt.pt: no such file"),
    ("classifier", ["--resume", "{corrupt}"], "truncated or not a PyTorch checkpoint"),
    ("classifier", ["--resume", "{evil}"], "could run code; weights_only=True refused it"),
    ("classifier", ["--resume", "{moco}"], "a checkpoint of train_moco.py, not of train_classifier.py"),
    ("classifier", ["--resume", "{cls}", "--arch", "small_cnn"], "--arch: checkpoint lenet, now small_cnn"),
    ("classifier", ["--resume", "{cls}", "--arch", "lenet", "--image-size", "16", "--batch-size", "2",
                    "--dataset", "imagefolder", "--data-dir", "{three_classes}"],
     "(number of classes: checkpoint 10, now 3)"),
    ("classifier", ["--out", "{a_file}"], "is a file, not a folder"),
    ("classifier", ["--out", "/sys/not-writable/run"], "cannot write in /sys"),
    ("classifier", ["--out", "{cls_dir}"], "already holds a run (checkpoint_last.pt at step 1, in epoch 1)"),
    ("classifier", ["--overwrite", "--resume", "auto"], "--overwrite starts over and --resume continues"),
    ("classifier", ["--device", "cuda"], "--device cuda: CUDA is not available"),
    ("classifier", ["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
    ("classifier", ["--epoch", "3"], "unrecognized arguments: --epoch 3; did you mean --epochs?"),
    ("classifier", ["--allow-changes"], "--allow-changes only applies with --resume"),
    ("classifier", ["--resume", "{no_train}"], "a folder without checkpoints; give a run's --out folder"),
    ("classifier", ["--resume", "{cls}", "--arch", "lenet", "--image-size", "16", "--batch-size", "16", "--lr", "0.5"],
     "its run had other settings (--lr 0.1 -> 0.5), so this would be another experiment"),
    ("classifier", ["--pretrained", "{no_train}"], "a folder without checkpoints; give a run's --out folder or a "
                                                   "checkpoint_*.pt file"),
    ("classifier", ["--probe-bn"], "--probe-bn only applies with --linear-probe"),
    ("classifier", ["--label-smoothing", "1"], "--label-smoothing must be in [0, 1), got 1.0"),
    ("classifier", ["--norm-weight-decay", "-0.5"], "--norm-weight-decay -0.5: give a weight decay >= 0, or -1 to "
                                                    "leave it unset"),
    ("classifier", ["--optimizer", "adam"], "argument --optimizer/--opt: invalid choice: 'adam'"),
    ("classifier", ["--optimizer", "rmsprop", "--nesterov"], "--nesterov is SGD's; --optimizer rmsprop has no such"),
    ("classifier", ["--nesterov", "--momentum", "0"], "Nesterov momentum needs momentum: give --momentum above 0"),
    ("classifier", ["--optimizer", "adamw", "--momentum", "0.8"], "--momentum does nothing with --optimizer adamw"),
    ("classifier", ["--ra-reps", "0"], "--ra-reps must be >= 1, got 0"),
    ("classifier", ["--dataset", "shards", "--data-dir", "{three_classes}", "--ra-reps", "4"],
     "--ra-reps 4 repeats samples of the samples order, but the shards order reads whole shards per rank; add "
     "--order samples, or drop --ra-reps"),
    ("classifier", ["--dataset", "shards", "--data-dir", "s3://bucket/x", "--ra-reps", "2"],
     "reads whole shards per rank; drop --ra-reps (an object store's shards are read in the shards order only)"),
    ("classifier", ["--resume", "{cls}", "--arch", "lenet", "--image-size", "16", "--batch-size", "16", "--ra-reps", "2",
                    "--allow-changes"],
     "saved part way through an epoch read with --ra-reps 1, which this run (--ra-reps 2) cannot continue; resume "
     "with --ra-reps 1, or from a checkpoint at an epoch's end"),
    ("classifier", ["--model-ema-steps", "8"], "--model-ema-steps does nothing without --model-ema"),
    ("classifier", ["--cutmix-alpha", "1", "--batch-size", "1"], "--mixup-alpha/--cutmix-alpha mix the images of a "
                                                                 "micro-batch with each other: give --batch-size 2"),
    ("classifier", ["--model-ema", "--model-ema-steps", "0"], "--model-ema-steps must be positive, got 0"),
    ("classifier", ["--model-ema", "--model-ema-decay", "1"], "--model-ema-decay must be in (0, 1), got 1.0"),
    ("classifier", ["--lr-schedule", "cosineannealinglr", "--lr-min", "0.1"], "--lr-min 0.1 is the LR the cosine decays "
                                                                              "to: give it below --lr 0.1"),
    ("classifier", ["--lr-warmup-epochs", "5"], "--lr-warmup-epochs applies to --lr-schedule cosineannealinglr, "
                                                "constant, steplr, exponentiallr (torchvision's warm-up per epoch), "
                                                "not cosine"),
    ("classifier", ["--lr-schedule", "cosineannealinglr", "--lr-warmup-epochs", "5", "--warmup-steps", "100"],
     "give one warm-up: --warmup-steps (in optimizer steps) or --lr-warmup-epochs"),
    ("classifier", ["--lr-schedule", "cosineannealinglr", "--lr-warmup-epochs", "10", "--epochs", "10"],
     "--lr-warmup-epochs 10 must be less than --epochs 10"),
    ("classifier", ["--lr-warmup-decay", "0.1"], "--lr-warmup-decay does nothing without --lr-warmup-epochs"),
    ("classifier", ["--resume", "{cls}", "--arch", "lenet", "--image-size", "16", "--batch-size", "16",
                    "--bias-weight-decay", "0", "--allow-changes"],
     "its optimizer holds the parameter groups all, this run's other, bias: give --norm-weight-decay and "
     "--bias-weight-decay as its run did"),
    ("classifier", ["--resume", "{cls}", "--arch", "lenet", "--image-size", "16", "--batch-size", "16",
                    "--optimizer", "adamw"], "--optimizer: checkpoint sgd, now adamw"),
    ("classifier", ["--pretrained", "/nonexistent/backbone.pt"], "--pretrained /nonexistent/backbone.pt: no such file"),
    ("classifier", ["--pretrained", "{moco}", "--arch", "lenet"], "a small_cnn backbone, but this run has --arch lenet"),
    ("classifier", ["--pretrained", "{corrupt}"], "truncated or not a PyTorch checkpoint"),
    ("classifier", ["--auto-augment", "ta_wide"], "--auto-augment needs 8-bit images (cifar10, imagefolder, shards); "
                                                  "--dataset digits's are float tensors: drop --auto-augment"),
    ("classifier", ["--auto-augment", "rand"], "argument --auto-augment: invalid choice: 'rand'"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{three_classes}", "--auto-augment", "ta_wide",
                    "--aug-on", "device"], "--auto-augment runs per sample in the DataLoader workers, not on the "
                                           "device: give --aug-on loader (or auto)"),
    ("classifier", ["--random-erase", "0.1", "--aug-on", "device"], "--random-erase runs per sample in the DataLoader "
                                                                    "workers, not on the device: give --aug-on loader"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{three_classes}", "--auto-augment", "ta_wide",
                    "--decode-on", "device"], "--decode-on device needs --aug-on device (the loader path decodes and "
                                              "augments each image in the workers; --aug-on auto means the loader"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{three_classes}", "--random-erase", "0.1",
                    "--no-augment"], "--random-erase augments the training images and --no-augment turns "
                                     "augmentation off; drop one of them"),
    ("classifier", ["--random-erase", "1.5"], "--random-erase must be in [0, 1], got 1.5"),
    ("classifier", ["--ra-magnitude", "5"], "--ra-magnitude applies to --auto-augment ra (and ta_wide, where it does "
                                            "nothing): add --auto-augment ra, or drop --ra-magnitude"),
    ("classifier", ["--auto-augment", "ra", "--ra-magnitude", "31", "--dataset", "imagefolder", "--data-dir",
                    "{three_classes}"], "--ra-magnitude must be in [0, 30], got 31"),
    ("classifier", ["--augmix-severity", "5"], "--augmix-severity applies to --auto-augment augmix only"),
    ("classifier", ["--train-crop-size", "24"], "--train-crop-size applies to image files (imagefolder, shards), not "
                                                "--dataset digits: drop it"),
    ("classifier", ["--dataset", "cifar10", "--val-resize-size", "36"], "--val-resize-size applies to image files "
                                                                        "(imagefolder, shards), not --dataset cifar10"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{three_classes}", "--val-resize-size", "200"],
     "--val-resize-size 200 is smaller than the evaluation crop --image-size 224: give at least 224"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{three_classes}", "--arch", "lenet",
                    "--train-crop-size", "8"], "--train-crop-size 8 is too small for --arch lenet: give at least 16"),
    ("classifier", ["--dataset", "imagefolder", "--data-dir", "{three_classes}", "--arch", "resnet18",
                    "--train-crop-size", "48"], "--arch resnet18 has a CIFAR stem up to 64 px and ImageNet's above, "
                                                "chosen by --image-size 224: --train-crop-size 48 would train it"),
    ("classifier", ["--resume", "{fixres}", "--dataset", "imagefolder", "--data-dir", "{three_classes}", "--arch",
                    "small_cnn", "--image-size", "16", "--batch-size", "2", "--train-crop-size", "10"],
     "its run had other settings (--train-crop-size 12 -> 10), so this would be another experiment"),
    ("moco", ["--no-augment"], "--no-augment: MoCo learns from two differently augmented views"),
    ("moco", ["--moco-k", "16", "--batch-size", "32"], "--moco-k 16 is smaller than the global batch"),
    ("moco", ["--moco-k", "48", "--batch-size", "32", "--accum-steps", "2"], "accum steps 2 x batch 32 = 64"),
    ("moco", ["--symmetric", "--moco-k", "48", "--batch-size", "32"],
     "with --symmetric (2 crops x world size 1 x accum steps 1 x batch 32 = 64)"),
    ("moco", ["--batch-size", "31"], "must be a multiple of --bn-splits 2"),
    ("moco", ["--bn-splits", "0"], "--bn-splits must be positive"),
    ("moco", ["--moco-m", "1.0"], "--moco-m must be in [0, 1)"),
    ("moco", ["--moco-t", "nan"], "argument --moco-t: nan is not a finite number"),
    ("moco", ["--moco-t", "0"], "--moco-t must be positive"),
    ("moco", ["--moco-dim", "0"], "--moco-dim must be positive"),
    ("moco", ["--knn-k", "0"], "--knn-k must be positive"),
    ("moco", ["--knn-t", "-1"], "--knn-t must be positive"),
    ("moco", ["--knn-every", "-1"], "--knn-every must be >= 0"),
    ("moco", ["--knn-bank-samples", "-5"], "--knn-bank-samples must be >= 0"),
    ("moco", ["--aug-on", "gpu"], "argument --aug-on: invalid choice: 'gpu'"),
    ("moco", ["--preset", "v3"], "argument --preset: invalid choice: 'v3'"),
    ("moco", ["--aug", "v9"], "argument --aug: invalid choice: 'v9'"),
    ("moco", ["--resume", "{cls}"], "a checkpoint of train_classifier.py, not of train_moco.py"),
    ("moco", ["--resume", "{moco}", "--image-size", "16", "--moco-k", "128", "--moco-dim", "64", "--no-mlp"],
     "(--moco-dim: checkpoint 128, now 64; --moco-k: checkpoint 256, now 128; --mlp: checkpoint True, now False)"),
    ("moco", ["--resume", "{moco}", "--image-size", "16", "--moco-k", "256", "--arch", "lenet"],
     "--arch: checkpoint small_cnn, now lenet"),
    ("moco", ["--resume", "{moco}", "--moco-k", "256", "--arch", "resnet18", "--batch-size", "16"],
     "--arch: checkpoint small_cnn, now resnet18"),
]
IDS = [f"{script} {' '.join(args)}" for script, args, _ in CASES]
# One case of each mechanism (argparse, checkpoint checks, data checks) also goes through a real
# interpreter, as a user types it.
THROUGH_CLI = [IDS.index(i) for i in (
    "classifier --lr nan", "classifier --resume {evil}", "classifier --dataset imagefolder --data-dir {no_train}",
    "classifier --dataset shards --data-dir {three_classes} --ra-reps 4",
    "classifier --dataset imagefolder --data-dir {three_classes} --auto-augment ta_wide --aug-on device",
)]  # a used --out and a typo: through the launchers, in test_user_path.py


def _argv(args: list[str], files: dict[str, Path], script: str, out: Path) -> list[str]:
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    extra = FAST if script == "moco" else FAST[:2]
    return extra + (["--out", str(out)] if "--out" not in argv else []) + argv


def _folder_state(path: Path) -> list[tuple[str, int]]:
    return sorted((str(p), p.stat().st_mtime_ns) for p in path.rglob("*")) if path.is_dir() else []


@pytest.mark.parametrize("script, args, message", CASES, ids=IDS)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, files, script, args, message):
    """In-process through main(), the scripts' entry point (fast); THROUGH_CLI repeats a subset."""
    if "--device" in args and "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "run"
    argv = _argv(args, files, script, out)
    before = _folder_state(files["cls_dir"])
    try:
        code = SCRIPTS[script].main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.out + captured.err
    assert len(lines) == 1, lines
    assert message in lines[0]
    assert "Traceback" not in captured.err + captured.out and "weights_only=False" not in captured.err
    assert captured.out == ""  # nothing on stdout either: the one line is all
    assert not out.exists(), "bad input must not leave a run folder"
    assert _folder_state(files["cls_dir"]) == before, "an existing run must be left as it was"
    assert not files["marker"].exists(), "the hostile checkpoint's code ran"


def test_a_subset_through_the_real_cli(tmp_path, files):
    def run(i: int) -> tuple[int, subprocess.CompletedProcess]:
        script, args, _ = CASES[i]
        argv = _argv(args, files, script, tmp_path / f"run{i}")
        cmd = [sys.executable, str(REPO / f"train_{script}.py"), *argv]
        return i, subprocess.run(cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(2) as pool:  # 2 cores
        results = list(pool.map(run, THROUGH_CLI))
    for i, proc in results:
        script, args, message = CASES[i]
        if "cuda" in args and torch.cuda.is_available():
            continue
        assert proc.returncode == 2, (IDS[i], proc.stdout, proc.stderr)
        assert proc.stdout == "", (IDS[i], proc.stdout)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, (IDS[i], proc.stderr)
        assert proc.stderr.startswith(f"train_{script}.py: error: ")
        assert not (tmp_path / f"run{i}").exists()
    assert not files["marker"].exists()


@pytest.mark.slow  # two torchrun jobs; in-process, every case above is checked in the fast tier
@pytest.mark.torch_versions  # what torchrun prints of a worker's failure
@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size must be positive"),           # a flag check, before the group forms
    (["--resume", "{corrupt}"], "truncated or not a PyTorch checkpoint"),  # a file check, agreed by the ranks
])
def test_bad_input_under_torchrun_is_printed_once(tmp_path, files, args, message):
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    proc = run_cli("train_classifier.py", ["--device", "cpu", "--out", str(tmp_path / "r"), *argv],
                   nproc=2, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count(message) == 1, proc.stderr  # rank 0 says it; rank 1 exits 2 silently
    assert "exitcode  : 2" in proc.stderr  # torchrun's summary of the workers' exit codes
    # torchrun's agent prints its own traceback and summary of the failed workers; none of the
    # workers' code appears in any traceback.
    assert "ddp_utils" not in proc.stderr and 'train_classifier.py", line' not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_debug_under_a_launcher_is_refused(tmp_path, capsys, monkeypatch):
    """--debug is one process: as rank 0 of 2 (torchrun's variables), one line and exit 2 before
    any process group forms."""
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    proc = in_process(train_classifier.main, ["--debug", "--device", "cpu", "--out", str(tmp_path / "r")], capsys)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert "--debug runs one process; start it with plain `python`, not torchrun/srun" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_bad_fault_plan_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDP_FAULT", "explode:1")
    proc = in_process(train_classifier.main, ["--device", "cpu", "--out", str(tmp_path / "r")], capsys)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "DDP_FAULT='explode:1': expected KIND:RANK:STEP" in proc.stderr


# ----------------------------------------------------------------------------- every numeric flag
# Where 0 or -1 is a legal value (0 = off / auto / plain SGD; -1 workers = auto; any seed).
ZERO_OK = {"image_size", "workers", "max_steps", "momentum", "weight_decay", "warmup_steps", "clip_grad",
           "seed", "ckpt_every", "skip_nonfinite", "knn_every", "knn_bank_samples", "moco_m", "shard_cache_gb",
           "shard_read_ahead", "lr_warmup_epochs", "label_smoothing", "norm_weight_decay", "bias_weight_decay",
           "ra_magnitude", "random_erase", "train_crop_size", "val_resize_size", "mixup_alpha", "cutmix_alpha",
           "lr_min", "lr_ranks", "transformer_embedding_decay"}
NEGATIVE_OK = {"seed", "workers", "norm_weight_decay", "bias_weight_decay", "transformer_embedding_decay"}  # -1: unset
IN_A_BUCKET = ["--dataset", "shards", "--data-dir", "s3://bucket/x"]  # where the object store's flags apply


# what a flag that applies to some runs only needs, where the defaults are not such a run
NEEDS = {"lr_warmup_decay": ["--lr-schedule", "cosineannealinglr", "--lr-warmup-epochs", "1"],
         "model_ema_steps": ["--model-ema"], "model_ema_decay": ["--model-ema"],
         "auto_augment": ["--dataset", "cifar10"], "ra_magnitude": ["--dataset", "cifar10", "--auto-augment", "ra"],
         "augmix_severity": ["--dataset", "cifar10", "--auto-augment", "augmix"],
         "train_crop_size": ["--dataset", "imagefolder"], "val_resize_size": ["--dataset", "imagefolder"],
         "interpolation": ["--dataset", "imagefolder"], "probe_bn": ["--linear-probe"],
         "allow_changes": ["--resume", "auto"], "lr_step_size": ["--lr-schedule", "steplr"],
         "lr_gamma": ["--lr-schedule", "exponentiallr"], "lr_min": ["--lr-schedule", "cosineannealinglr"]}


# The flags that apply at the defaults, and where they do not (the others: on the defaults)
NOT_APPLYING = {"nesterov": ["--optimizer", "adamw"], "momentum": ["--optimizer", "adamw"], "ra_reps": ["--dataset", "shards", "--data-dir", "shards"]}


def applying(name: str) -> list[str]:
    """The flags a field's own flag needs to apply at all (the object store's: a bucket; a
    warm-up's start factor: the warm-up; the EMA's settings: the EMA)."""
    from ddp_utils.train.train_config import IN_AN_OBJECT_STORE, TrainConfig

    in_a_bucket = [f.name for f in dataclasses.fields(TrainConfig) if f.metadata["applies_to"] is IN_AN_OBJECT_STORE]
    return IN_A_BUCKET if name in in_a_bucket else NEEDS.get(name, [])


def _numeric_cases():
    import typing

    from ddp_utils.config import field_type

    for script, cls in CONFIGS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = field_type(hints[f.name])
            if kind not in (int, float):
                continue
            values = ["0", "-1"] + (["nan", "inf", "-inf"] if kind is float else [])
            for value in values:
                yield script, f.name, value


NUMERIC = list(_numeric_cases())


@pytest.mark.parametrize("script, name, value", NUMERIC, ids=[f"{s} --{n}={v}" for s, n, v in NUMERIC])
def test_every_numeric_flag_at_zero_negative_nan_and_inf(capsys, script, name, value):
    """Each numeric flag of both scripts: 0 and -1 are refused unless they mean something (off,
    auto), nan and +-inf always; a refusal is one line naming the flag."""
    from ddp_utils.config import flag_name, parse_config
    from ddp_utils.runtime.launch import LaunchEnv

    cls = CONFIGS[script]
    flag = flag_name(name)
    legal = value not in ("nan", "inf", "-inf") and (
        (value == "0" and name in ZERO_OK) or (value == "-1" and name in NEGATIVE_OK))
    try:
        cfg = parse_config(cls, [*applying(name), f"{flag}={value}"])
        cfg.validate(LaunchEnv("single", 0, 0, 1, 1), cuda_devices=0)
        problem = None
    except SystemExit:
        problem = capsys.readouterr().err
    except UsageError as err:
        problem = str(err)
    if legal:
        assert problem is None, problem
    else:
        assert problem is not None and problem.strip().count("\n") == 0 and flag in problem, problem


def _bounded_fields():
    for script, cls in CONFIGS.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("bounds"):
                yield script, cls, f


BOUNDED = list(_bounded_fields())


def just_outside(bounds: dict, kind: type) -> list:
    """A value just past each of a field's bounds (1 for an int, 0.5 for a float), of its type."""
    step = 1 if kind is int else 0.5
    values = [bounds["at_least"] - step if "at_least" in bounds else None, bounds.get("above"), bounds.get("below"),
              bounds["at_most"] + step if "at_most" in bounds else None]
    return [kind(v) for v in values if v is not None]


def test_bounds_sit_on_the_fields_and_one_checker_enforces_them():
    """Every bound is an opt() keyword: a value just outside it is refused with "FLAG must be
    ..., got VALUE", the bound itself (where it is included) passes; a field a script redefines
    keeps its bounds; and the messages are the ones users meet."""
    from ddp_utils.config import bounds_text, check_bounds, flag_name
    from ddp_utils.train.train_config import TrainConfig

    assert len(BOUNDED) >= 30  # 18 shared fields in both scripts, MoCo's own
    for script, cls, f in BOUNDED:
        bounds, kind = f.metadata["bounds"], type(f.default)
        cfg = cls()
        for value in just_outside(bounds, kind):
            with pytest.raises(UsageError) as err:
                check_bounds(dataclasses.replace(cfg, **{f.name: value}))
            assert str(err.value) == f"{flag_name(f.name)} must be {bounds_text(bounds)}, got {value}"
        for edge in ("at_least", "at_most"):
            if edge in bounds:
                check_bounds(dataclasses.replace(cfg, **{f.name: kind(bounds[edge])}))
        check_bounds(cfg)  # the defaults are within bounds
    shared = {f.name: f.metadata.get("bounds") for f in dataclasses.fields(TrainConfig)}
    for script, cls in CONFIGS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("bounds") == shared.get(f.name, f.metadata.get("bounds")), (script, f.name)
    texts = {(s, f.name): bounds_text(f.metadata["bounds"]) for s, _, f in BOUNDED}
    assert texts[("classifier", "lr")] == "positive" and texts[("classifier", "momentum")] == "in [0, 1)"
    assert texts[("moco", "crop_min")] == "in (0, 1]" and texts[("classifier", "max_steps")] == ">= 0"


def test_every_bound_is_refused_on_the_command_line_and_its_edge_accepted(capsys):
    """The command line's path (parse_args: argparse, then validate): for every bounded field, a
    value just outside a bound exits 2 with one line "FLAG must be ..., got VALUE"; an included
    bound (at_least, at_most) starts."""
    from ddp_utils.config import bounds_text, flag_name
    from ddp_utils.train.train_config import parse_args

    def run(cls, flag, value):
        try:
            parse_args(cls, ["--device", "cpu", *applying(flag[2:].replace("-", "_")), f"{flag}={value}"], "doc")
            return 0, capsys.readouterr().err
        except SystemExit as stop:
            return stop.code, capsys.readouterr().err

    for script, cls, f in BOUNDED:
        bounds, kind, flag = f.metadata["bounds"], type(f.default), flag_name(f.name)
        for value in just_outside(bounds, kind):
            code, err = run(cls, flag, value)
            assert code == 2 and err.count("\n") == 1, (script, flag, value, err)
            assert err.endswith(f": error: {flag} must be {bounds_text(bounds)}, got {value}\n"), err
        for edge in ("at_least", "at_most"):
            if edge in bounds:
                assert run(cls, flag, kind(bounds[edge])) == (0, ""), (script, flag, edge)
    # by hand, so that the loop above cannot pass on empty metadata
    for cls, flag, value, said in [(train_classifier.ClassifierConfig, "--momentum", 1, "in [0, 1), got 1.0"),
                                   (train_classifier.ClassifierConfig, "--lr", 0, "positive, got 0.0"),
                                   (train_moco.MocoConfig, "--crop-min", 1.5, "in (0, 1], got 1.5")]:
        code, err = run(cls, flag, value)
        assert code == 2 and err.endswith(f": error: {flag} must be {said}\n"), err
    assert run(train_classifier.ClassifierConfig, "--momentum", 0) == (0, "")


def _applying_fields():
    for script, cls in CONFIGS.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("applies_to") is not None:
                yield script, cls, f


APPLYING = list(_applying_fields())


def _another_value(f: dataclasses.Field):
    """A command-line value of field ``f`` other than its default, within its bounds and choices."""
    if isinstance(f.default, bool):
        return [flag_name_of(f, negated=f.default)]
    if f.metadata.get("choices"):
        return [flag_name_of(f), next(c for c in f.metadata["choices"] if c != f.default)]
    if isinstance(f.default, str):
        return [flag_name_of(f), "elsewhere"]
    value = f.default + 1 if isinstance(f.default, int) else (f.default / 2 or 1.0)
    return [flag_name_of(f), str(value)]


def flag_name_of(f: dataclasses.Field, negated: bool = False) -> str:
    from ddp_utils.config import flag_name

    return flag_name(("no_" if negated else "") + f.name)


@pytest.mark.parametrize("script, cls, f", APPLYING, ids=[f"{s} {f.name}" for s, _, f in APPLYING])
def test_a_flag_where_it_does_nothing_is_one_line_that_says_where_it_applies(monkeypatch, script, cls, f):
    """Every flag with opt(applies_to=...), given where it does nothing (the defaults: digits, no
    bucket, no warm-up in epochs, no EMA, no automatic augmentation; NOT_APPLYING for those that
    apply there): one line naming the flag and where it applies, which its --help says too; where
    it applies (``applying``, or the defaults), no such line."""
    from ddp_utils.config import build_parser, check_applies, flag_name, help_text, parse_config
    from ddp_utils.runtime.launch import LaunchEnv

    flag, where = flag_name(f.name), f.metadata["applies_to"].where
    cfg = parse_config(cls, [*NOT_APPLYING.get(f.name, []), *_another_value(f)])
    with pytest.raises(UsageError) as refused:
        cfg.validate(LaunchEnv("single", 0, 0, 1, 1), cuda_devices=0)
    said = str(refused.value)
    assert said.startswith(flag + " ") and where in said and "\n" not in said, said
    assert help_text(cls, f).endswith(f"; applies to: {where}")
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help at hyphens: one line per flag
    assert f"applies to: {where}" in build_parser(cls).format_help()
    check_applies(parse_config(cls, []))  # the default is never refused
    if applying(f.name) or f.name in NOT_APPLYING:  # a bucket, the warm-up, the EMA, a policy, image files, sgd, samples
        check_applies(parse_config(cls, [*applying(f.name), *_another_value(f)]))


def test_the_flags_that_apply_to_some_runs_only_are_these():
    """By hand, so that the generated test above cannot pass on empty metadata."""
    store = ["shard_cache_dir", "shard_cache_gb", "shard_read_ahead", "shard_downloads", "store_timeout",
             "store_if_match", "keep_shard_cache"]
    shared = ["data_dir", *store, "download", "synthetic_samples", "decode_on", "lr_step_size", "lr_gamma", "lr_min",
              "lr_warmup_method", "lr_warmup_decay", "allow_changes", "check_data"]
    assert [f.name for s, _, f in APPLYING if s == "moco"] == shared
    momentum = shared.index("decode_on") + 1  # the classifier's --momentum: not beside AdamW
    assert [f.name for s, _, f in APPLYING if s == "classifier"] == [
        *shared[:momentum], "momentum", *shared[momentum:], "probe_bn", "nesterov", "model_ema_steps", "model_ema_decay", "auto_augment", "ra_magnitude", "augmix_severity", "ra_reps", "train_crop_size",
        "val_resize_size", "interpolation"]
    wheres = {f.name: f.metadata["applies_to"].where for _, _, f in APPLYING}
    assert wheres["data_dir"] == "cifar10, imagefolder and shards" and wheres["download"] == "cifar10"
    assert wheres["store_timeout"] == "shards in an object store (s3://)" and wheres["check_data"] == \
        "imagefolder and shards"


def test_a_value_that_applies_somewhere_only_is_refused_elsewhere_by_its_fields_rule():
    """opt(value_applies=...): each such value (listed by hand, so that empty metadata cannot
    pass) refused by check_applies where it does not apply, in the rule's one line, and taken
    where it does; the other values of its flag are not refused."""
    from ddp_utils.config import check_applies, flag_name, parse_config

    rules = {(script, f.name, value) for script, cls in CONFIGS.items() for f in dataclasses.fields(cls)
             for value in f.metadata.get("value_applies", {})}
    assert rules == {(s, name, value) for s in ("moco", "classifier") for name, value in (
        ("order", "shards"), ("order", "samples"), ("normalization", "cifar10-demo"), ("aug_on", "device"))}
    # (name, value): the flags where it does not apply, where it does, and how its refusal begins
    where = {("order", "shards"): (["--dataset", "digits"], ["--dataset", "shards", "--data-dir", "/tmp/x"],
                                   "--order shards "),
             ("order", "samples"): (["--dataset", "shards", "--data-dir", "s3://bucket/x"], ["--dataset", "shards"],
                                    "--order samples "),
             ("normalization", "cifar10-demo"): (["--dataset", "digits"], ["--dataset", "cifar10"],
                                                 "--normalization cifar10-demo "),
             ("aug_on", "device"): (["--random-erase", "0.1"], [], "--random-erase runs per sample ")}
    for script, cls in CONFIGS.items():
        for (name, value), (elsewhere, applying, refusal) in where.items():
            flag = flag_name(name)
            if (script, name) != ("moco", "aug_on"):  # MoCo has no per-sample step for --aug-on device to meet
                with pytest.raises(UsageError, match=rf"^{re.escape(refusal)}[^\n]*$"):
                    check_applies(parse_config(cls, [*elsewhere, flag, value]))
            check_applies(parse_config(cls, [*applying, flag, value]))
        check_applies(parse_config(cls, ["--dataset", "digits", "--order", "samples", "--normalization", "auto",
                                         "--aug-on", "loader"]))


def test_a_bound_is_enforced_on_a_config_files_value_too(tmp_path, capsys):
    recipe = tmp_path / "recipe.json"
    recipe.write_text('{"momentum": 1.5, "device": "cpu"}')
    proc = in_process(train_classifier.main, ["--config", str(recipe)], capsys)
    assert proc.returncode == 2 and proc.stderr.endswith(": error: --momentum must be in [0, 1), got 1.5\n")
    assert proc.stderr.count("\n") == 1


def test_presets_write_their_values_once_and_name_them_in_the_help():
    """train_moco.PRESETS holds what each paper sets; the fields' defaults are the default preset's,
    and each such flag's help ends with the other presets' values, generated, never by hand."""
    from ddp_utils.config import help_text

    cls, presets = train_moco.MocoConfig, train_moco.PRESETS
    fields = {f.name: f for f in dataclasses.fields(cls)}
    # no data set's defaults touch a preset's flags, so the presets' values end their help
    assert not set().union(*presets.values()) & set().union(*train_moco.DATASET_DEFAULTS.values())

    def show(value):  # as --help shows it: on/off, and % written %% for argparse
        return {True: "on", False: "off"}.get(value, str(value).replace("%", "%%"))

    default = presets[fields["preset"].default]
    assert set(default) == set(presets["v1"])  # both presets set the same flags
    for name, value in default.items():
        assert fields[name].default == value, name
        text = help_text(cls, fields[name])
        for preset, values in presets.items():
            assert (f"--preset {preset}: {show(values[name])}" in text) == (values[name] != value), (name, text)
        others = [f"--preset {preset}: {show(values[name])}" for preset, values in presets.items()
                  if values[name] != value]
        assert others and text.endswith("; " + ", ".join(others)), (name, text)  # no data set sets these
    assert help_text(cls, fields["moco_t"]).endswith("; --preset v1: 0.07")
    assert help_text(cls, fields["mlp"]).endswith("; --preset v1: off")
    assert not [f.name for f in fields.values() if "(v1:" in f.metadata["help"] or "(v2:" in f.metadata["help"]]


def test_help_sections_are_named_once():
    """Each --help section is a constant, named by the fields that use it and listed in SECTIONS."""
    from ddp_utils.config import flag_groups

    for script, module in SCRIPTS.items():
        cls = CONFIGS[script]
        assert list(flag_groups(cls)) == list(cls.SECTIONS), script  # every section used, in order
        source = Path(module.__file__).read_text() + (REPO / "ddp_utils/train/train_config.py").read_text()
        assert 'group="' not in source, script


# ----------------------------------------------------------------------------- the README's table
SHOWN_AS = {"{no_train}": "DIR-without-train", "{empty_class}": "DIR-with-an-empty-class",
            "{three_classes}": "DIR-with-3-classes", "{corrupt}": "truncated.pt", "{evil}": "hostile.pt",
            "{moco}": "moco_ckpt.pt", "{cls}": "lenet_ckpt.pt", "{a_file}": "a_file", "{cls_dir}": "runs/existing"}


def readme_rows() -> list[str]:
    """The rows of the README's "Bad input" table, one per case (tests/test_docs.py compares)."""
    rows = ["| script | input | the one line says |", "| --- | --- | --- |"]
    for script, args, message in CASES:
        shown = " ".join(args)
        for placeholder, name in SHOWN_AS.items():
            shown = shown.replace(placeholder, name)
        rows.append(f"| {script} | `{shown}` | {message.replace('|', chr(92) + '|')} |")
    return rows


def test_a_one_line_load_error_is_reported_not_crashed_on(trained_moco, monkeypatch):
    """load_state_dict errors are usually a header line and details; one that is a single line
    must still give the one-line message, not an IndexError."""
    from ddp_utils.models.backbones import build_model
    from ddp_utils.train.pretrained import load_pretrained_backbone

    model = build_model("small_cnn", 10, 16)

    def refuse(state, strict=True):
        raise RuntimeError("a tensor on the meta device cannot be loaded")

    monkeypatch.setattr(model, "load_state_dict", refuse)
    with pytest.raises(UsageError, match=r"does not fit this --arch/--image-size \(a tensor on the meta device"):
        load_pretrained_backbone(model, trained_moco / "backbone.pt", "small_cnn")


def test_a_flag_error_is_said_in_a_jobs_first_attempt_only_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    """torchrun restarts a failed group whatever the cause: the line comes from the first attempt;
    nothing is written anywhere to remember it."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-17")
    first = in_process(train_classifier.main, ["--batch-size", "0"], capsys)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = in_process(train_classifier.main, ["--batch-size", "0"], capsys)
    assert (first.returncode, again.returncode) == (2, 2)
    assert first.stderr.count("--batch-size must be positive") == 1 and again.stderr == ""
    assert list(tmp_path.iterdir()) == []
