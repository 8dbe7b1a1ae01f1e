"""Bad input stops before training: one line naming the fix, exit code 2, nothing written."""
from __future__ import annotations

import pytest
from helpers import run_cli

import train_classifier

CASES = [
    (["--batch-size", "0"], "--batch-size must be positive"),
    (["--accum-steps", "-1"], "--accum-steps must be positive"),
    (["--epochs", "0"], "--epochs must be positive"),
    (["--max-steps", "-5"], "--max-steps must be >= 0"),
    (["--lr", "0"], "--lr must be positive"),
    (["--dataset", "mnist"], "argument --dataset: invalid choice: 'mnist'"),
    (["--arch", "vgg"], "argument --arch: invalid choice: 'vgg'"),
    (["--batch-size", "ten"], "argument --batch-size: invalid int value: 'ten'"),
    (["--dataset", "imagefolder", "--data-dir", "/nonexistent/imagenet"], "no 'train/' folder"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "add --download"),
    (["--resume", "/nonexistent/ckpt.pt"], "--resume /nonexistent/ckpt.pt: no such file"),
    (["--lr-schedule", "step"], "--lr-schedule step needs --lr-milestones"),
    (["--batch-size", "4096"], "too few for 1 rank(s) x batch 4096; lower --batch-size"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, message):
    """In-process for speed (main() is the CLI entry point); the subprocess cases follow."""
    out = tmp_path / "run"
    try:
        code = train_classifier.main(args + ["--out", str(out), "--device", "cpu"])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert message in lines[0]
    assert not out.exists(), "bad input must not leave a half-written run folder"


def test_bad_input_through_the_real_cli(tmp_path):
    proc = run_cli("train_classifier.py", ["--accum-steps", "0", "--out", str(tmp_path / "r")])
    assert proc.returncode == 2
    assert proc.stderr == "train_classifier.py: error: --accum-steps must be positive, got 0\n"
    assert proc.stdout == ""


def test_bad_input_under_torchrun_fails_on_every_rank_without_hanging(tmp_path):
    proc = run_cli("train_classifier.py", ["--batch-size", "0", "--out", str(tmp_path / "r")],
                   nproc=2, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("--batch-size must be positive") == 2  # both ranks said it
    assert "exitcode  : 2" in proc.stderr  # torchrun's summary of a worker's exit code


def test_debug_refuses_several_processes(tmp_path):
    proc = run_cli("train_classifier.py", ["--debug", "--out", str(tmp_path / "r")], nproc=2, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("--debug runs one process") == 2
