"""A new user's path through the real CLI: --check before a launch, launchers that stop a typo
with one line, a used --out never continued by surprise, a run's history kept in config.json,
a finished run resumed, run folders where a checkpoint is expected, --help in sections, and
warnings for a queue or probe that do not fit."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CLASSIFIER_REF, REPO, assert_ok, assert_same_state, cli_env, in_process, load_ckpt

import train_classifier
import train_moco
from ddp_utils.config import build_parser, flag_groups, parse_config

TINY = ["--device", "cpu", "--dataset", "digits", "--arch", "lenet", "--image-size", "16", "--batch-size", "64",
        "--log-every", "1"]


def cli(script: str, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd, env=cli_env(env),
                          capture_output=True, text=True, timeout=300)


def launcher(name: str, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / name), str(REPO / "train_classifier.py"), *args], cwd=cwd,
                          env=cli_env({"PYTHON": sys.executable, **env}), capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished one-process classifier run: 2 epochs of 22 steps, a checkpoint per epoch kept."""
    root = tmp_path_factory.mktemp("user")  # the real CLI: config.json's run is repeated through it below
    assert_ok(cli("train_classifier.py", TINY + ["--epochs", "2", "--keep-checkpoints", "3", "--out", "runs/a"], root))
    return root / "runs/a"


# ----------------------------------------------------------------------------- --check and the launchers
def test_check_prints_the_run_and_writes_nothing(tmp_path, capsys):
    """The bare command's run: the embedded data set's own defaults, said in the data line, and
    nothing to warn about."""
    proc = in_process(train_moco.main, ["--check", "--device", "cpu", "--out", str(tmp_path / "runs/m")], capsys)
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert lines[0] == "train_moco.py --check: ok, nothing written; the run:"
    assert ("  data: digits, 1,438 training and 359 validation images; 16 px, augmentation on the device (--aug-on "
            "auto), 0 DataLoader worker(s) per rank (--workers -1: in-memory data needs none); at the digits data set's "
            "own defaults: --image-size 16, --batch-size 32, --epochs 15, --lr 0.06, --moco-k 256, --moco-m 0.99, "
            "--bn-splits 2, --knn-every 5") in lines
    assert "  steps: 44 per epoch, 660 in 15 epochs" in lines
    assert "warning" not in proc.stdout and proc.stderr == "" and not (tmp_path / "runs").exists()


def test_the_data_sets_own_defaults_yield_to_flags_files_and_other_data_sets(tmp_path, capsys):
    """digits' defaults are used only where nothing else gave a value: a flag and a --config file
    win, and another --dataset keeps the fields' (ImageNet's) values. --help says both."""
    own = train_moco.DATASET_DEFAULTS["digits"]
    fields = {f.name: f.default for f in dataclasses.fields(train_moco.MocoConfig)}
    bare = parse_config(train_moco.MocoConfig, [])
    assert {name: getattr(bare, name) for name in own} == own != {name: fields[name] for name in own}
    cifar = parse_config(train_moco.MocoConfig, ["--dataset", "cifar10"])
    assert {name: getattr(cifar, name) for name in own} == {name: fields[name] for name in own}
    assert (cifar.moco_k, cifar.moco_m, cifar.lr) == (65536, 0.999, 0.03)
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"moco_k": 64, "dataset": "digits"}))
    mixed = parse_config(train_moco.MocoConfig, ["--config", str(recipe), "--lr", "0.5"])
    assert (mixed.moco_k, mixed.lr, mixed.moco_m) == (64, 0.5, own["moco_m"])
    from_file = tmp_path / "cifar.json"
    from_file.write_text(json.dumps({"dataset": "cifar10"}))
    assert parse_config(train_moco.MocoConfig, ["--config", str(from_file)]).moco_k == 65536
    for dataset, shown in (("digits", 256), ("imagefolder", 65536)):  # --help: the defaults this run would use
        with pytest.raises(SystemExit):
            parse_config(train_moco.MocoConfig, ["--dataset", dataset, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"must be >= the global batch; --dataset digits: 256 (default: {shown})" in text


def test_imagenets_queue_on_digits_is_warned_about(tmp_path, capsys):
    proc = in_process(train_moco.main, ["--check", "--device", "cpu", "--moco-k", "65536", "--out",
                                        str(tmp_path / "runs/m")], capsys)
    assert proc.returncode == 0  # it would hold each image's keys 45 times over
    assert "  warning: --moco-k 65536 is 45.6x the 1,438 training images" in proc.stdout
    assert "use --moco-k 1024 or less" in proc.stdout


def test_the_digits_recipes_queue_fits(tmp_path, capsys):
    proc = in_process(train_moco.main, ["--config", str(REPO / "recipes/moco_digits_quickstart.json"), "--check",
                                        "--out", str(tmp_path / "m")], capsys)
    assert proc.returncode == 0 and "warning" not in proc.stdout


def test_a_launcher_without_its_script_or_torch_says_so_in_one_line(tmp_path):
    """Before anything imports torch: a missing script (NPROC given as an argument, say) and a
    python without torch (the environment not activated) are one line each and exit 2."""
    no_script = subprocess.run(["bash", str(REPO / "launch/torchrun_local.sh"), "2", "train_moco.py"], cwd=tmp_path,
                               env=cli_env({"PYTHON": sys.executable}), capture_output=True, text=True, timeout=60)
    assert (no_script.returncode, no_script.stdout) == (2, "")
    assert no_script.stderr == ("torchrun_local.sh: '2' is not a file; the training script comes first, "
                                "e.g. NPROC=2 torchrun_local.sh train_moco.py ARGS\n")
    bare_python = tmp_path / "python"  # this interpreter without its site-packages, where torch is
    bare_python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare_python.chmod(0o755)
    for python in (bare_python, tmp_path / "missing-python"):
        proc = launcher("torchrun_local.sh", ["--device", "cpu"], tmp_path, NPROC="2", PYTHON=str(python))
        assert (proc.returncode, proc.stdout) == (2, "")
        assert proc.stderr == (f"torchrun_local.sh: '{python}' cannot import torch; activate the project's "
                               "environment (source .venv/bin/activate) or set PYTHON=.venv/bin/python\n")


def test_a_launcher_stops_a_typo_with_one_line_and_no_restart(tmp_path):
    """The check runs once before torchrun: no worker starts, so nothing restarts a usage error."""
    proc = launcher("torchrun_local.sh", ["--device", "cpu", "--epoch", "3"], tmp_path, NPROC="2")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == ("train_classifier.py: error: unrecognized arguments: --epoch 3; did you mean "
                           "--epochs? (see --help)\n")


def test_a_launcher_refuses_a_used_out_on_the_first_attempt(finished, tmp_path):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in finished.iterdir())
    proc = launcher("torchrun_multinode.sh", TINY + ["--epochs", "3", "--out", str(finished)], tmp_path,
                    NNODES="1", NPROC="2", RDZV_ENDPOINT="127.0.0.1:1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "already holds a run (checkpoint_last.pt at step 44" in proc.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in finished.iterdir()) == before


def test_if_restarted_starts_fresh_and_continues_only_in_a_restart(finished, tmp_path, capsys, monkeypatch):
    args = TINY + ["--epochs", "2", "--resume", "if-restarted"]
    first = in_process(train_classifier.main, args + ["--out", str(finished)], capsys)
    assert first.returncode == 2 and "already holds a run" in first.stderr
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = in_process(train_classifier.main, args + ["--out", str(finished)], capsys)
    assert again.returncode == 0 and "restarted attempt: continuing from the newest checkpoint" in again.stdout


# ----------------------------------------------------------------------------- resuming
def test_a_finished_run_resumed_says_so_with_its_metrics_and_writes_nothing(finished, capsys):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in finished.rglob("*"))
    proc = in_process(train_classifier.main, TINY + ["--epochs", "2", "--resume", "auto", "--out", str(finished)],
                      capsys)
    assert proc.returncode == 0
    assert "checkpoint_last.pt is complete (step 44, end of epoch 2, --epochs 2): nothing to train; last logged: " \
           "val/acc1 " in proc.stdout
    assert "Raise --epochs to train longer" in proc.stdout
    assert sorted((p.name, p.stat().st_mtime_ns) for p in finished.rglob("*")) == before


def test_a_finished_run_on_two_ranks_resumed_in_one_process_names_no_rng_streams(classifier_reference, tmp_path,
                                                                                 capsys):
    """Nothing is trained, so the RNG streams of another world size, which a resume cannot restore,
    go unmentioned."""
    last = classifier_reference.out / "checkpoint_last.pt"
    proc = in_process(train_classifier.main, CLASSIFIER_REF + ["--resume", str(last), "--out", str(tmp_path / "x")],
                      capsys)
    assert proc.returncode == 0 and "is complete (step 44, end of epoch 2, --epochs 2): nothing to train" in proc.stdout
    assert "RNG" not in proc.stdout + proc.stderr


def test_a_changed_experiment_is_refused_then_recorded_and_config_json_repeats_the_original(finished, tmp_path,
                                                                                           capsys):
    """Resuming with another LR is refused (exit 2, one line); --allow-changes continues and
    appends the change to config.json's history, whose "config" stays the original run's: --config
    on it trains the original run again, bit for bit."""
    work = tmp_path / "work"
    work.mkdir()
    run = tmp_path / "a"
    subprocess.run(["cp", "-r", str(finished), str(run)], check=True)
    original = json.loads((run / "config.json").read_text())
    changed = TINY + ["--epochs", "3", "--keep-checkpoints", "3", "--lr", "0.05", "--resume", str(run), "--out",
                      str(run)]
    refused = in_process(train_classifier.main, changed, capsys)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "its run had other settings (--lr 0.1 -> 0.05), so this would be another experiment" in refused.stderr
    assert in_process(train_classifier.main, changed + ["--allow-changes"], capsys).returncode == 0
    record = json.loads((run / "config.json").read_text())
    assert record["config"] == original["config"] and record["command"] == original["command"]
    [entry] = record["history"]
    assert entry["changes"] == {"--epochs": [2, 3], "--lr": [0.1, 0.05]}
    assert entry["at_step"] == 44 and entry["from"] == str(run / "checkpoint_last.pt") and entry["world_size"] == 1
    assert load_ckpt(run / "checkpoint_last.pt")["step"] == 66
    again = cli("train_classifier.py", ["--config", str(run / "config.json"), "--out", "b"], work)
    assert_ok(again)
    assert "warning" not in again.stderr  # same world size, same global batch
    assert_same_state(load_ckpt(work / "b/checkpoint_last.pt"), load_ckpt(run / "checkpoint_prev1.pt"))


def test_config_json_of_another_world_size_warns_in_one_line(finished, tmp_path, capsys):
    record = json.loads((finished / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**record, "world_size": 2}))
    proc = in_process(train_classifier.main, ["--config", str(tmp_path / "config.json"), "--check",
                                              "--out", str(tmp_path / "b")], capsys)
    assert proc.returncode == 0
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.endswith(f": warning: {tmp_path / 'config.json'} ran on 2 rank(s), global batch 128; this "
                                f"launch: 1 rank(s), global batch 64 (launch as many ranks, or scale --batch-size "
                                f"or --lr)\n")


def test_a_run_folder_means_its_newest_checkpoint(finished, tmp_path, capsys):
    proc = in_process(train_classifier.main, TINY + ["--epochs", "3", "--resume", str(finished), "--check",
                                                     "--out", str(finished)], capsys)
    assert proc.returncode == 0
    assert f"run folder: {finished}, continuing {finished / 'checkpoint_last.pt'} at step 44" in proc.stdout


# ----------------------------------------------------------------------------- the probe
def test_a_probe_takes_the_pretraining_size_and_warns_about_another(trained_moco, tmp_path, capsys):
    run = trained_moco / "run"  # pretrained at 16 px
    same = in_process(train_classifier.main, ["--pretrained", str(run), "--linear-probe", "--arch", "small_cnn",
                                              "--device", "cpu", "--check", "--out", str(tmp_path / "p")], capsys)
    assert same.returncode == 0 and "validation images; 16 px, " in same.stdout and "warning" not in same.stdout
    other = in_process(train_classifier.main, ["--pretrained", str(run), "--linear-probe", "--arch", "small_cnn",
                                               "--image-size", "32", "--device", "cpu", "--check",
                                               "--out", str(tmp_path / "p")], capsys)
    assert other.returncode == 0
    assert f"warning: --pretrained {run} was trained at 16 px, this run sees 32 px" in other.stdout
    random = in_process(train_classifier.main, ["--linear-probe", "--device", "cpu", "--check",
                                                "--out", str(tmp_path / "p")], capsys)
    assert random.returncode == 0
    assert "warning: --linear-probe without --pretrained: probing a randomly initialised backbone" in random.stdout


def test_a_run_records_the_image_size_as_asked_and_the_side_its_pretrained_backbone_fixed(trained_moco, tmp_path,
                                                                                          capsys):
    """--image-size 0 with --pretrained: config.json keeps the flag as given and the plan the side
    the backbone was trained at; that run's checkpoint, as --pretrained, gives the same side."""
    run = trained_moco / "run"  # pretrained at 16 px; digits' own side is 32
    tuned = tmp_path / "tuned"
    proc = in_process(train_classifier.main, ["--pretrained", str(run), "--arch", "small_cnn", "--device", "cpu",
                                              "--max-steps", "1", "--batch-size", "16", "--out", str(tuned)], capsys)
    assert_ok(proc)
    record = json.loads((tuned / "config.json").read_text())
    assert record["config"]["image_size"] == 0 and record["resolved"]["image_size"] == 16
    assert load_ckpt(tuned / "checkpoint_last.pt")["resolved"]["image_size"] == 16
    again = in_process(train_classifier.main, ["--pretrained", str(tuned), "--arch", "small_cnn", "--device", "cpu",
                                               "--check", "--out", str(tmp_path / "again")], capsys)
    assert again.returncode == 0 and "validation images; 16 px, " in again.stdout


def test_a_size_the_pretrained_backbone_fixes_is_refused_as_the_flag_would_be(trained_moco, jpeg_folder, tmp_path,
                                                                               capsys):
    """The checks of --image-size run on the side --pretrained fixes: a FixRes crop on the other
    stem than a 16 px backbone's is one line, exit 2, nothing written."""
    args = ["--pretrained", str(trained_moco / "run"), "--arch", "resnet18", "--dataset", "imagefolder", "--data-dir",
            str(jpeg_folder), "--train-crop-size", "176", "--batch-size", "2", "--device", "cpu", "--out", str(tmp_path / "out")]
    for check in ([], ["--check"]):
        proc = in_process(train_classifier.main, [*args, *check], capsys)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"--pretrained {trained_moco / 'run'} was trained at 16 px, the side --image-size 0 takes: --arch " \
               f"resnet18 has a CIFAR stem up to 64 px" in proc.stderr
    assert not (tmp_path / "out").exists()
    flags_alone = in_process(train_classifier.main, [*args[2:], "--check"], capsys)  # 224 px: the same stem as 176
    assert flags_alone.returncode == 0, flags_alone.stderr


# ----------------------------------------------------------------------------- --help
@pytest.mark.parametrize("cls", [train_classifier.ClassifierConfig, train_moco.MocoConfig])
def test_help_is_in_sections_with_the_launch_examples(cls):
    text = build_parser(cls, (REPO / ("train_moco.py" if cls is train_moco.MocoConfig else
                                      "train_classifier.py")).read_text().split('"""')[1]).format_help()
    titles = ["data:", "model and optimisation:", "precision and speed:", "run folder and checkpoints:",
              "distributed:"] + (["MoCo:", "kNN monitor:"] if cls is train_moco.MocoConfig else ["pretrained weights, evaluation:"])
    assert [line for line in text.splitlines() if line in ("options:", *titles)] == ["options:", *titles], \
        text  # each section once, in this order
    assert "(default: )" not in text and "(default: None)" not in text
    assert "torchrun --nnodes=2" in text and "sbatch" in text  # the docstring's launches, as the epilog
    grouped = {name for members in flag_groups(cls).values() for name in members}
    import dataclasses
    assert {f.name for f in dataclasses.fields(cls)} - grouped <= {"preset"}  # the preset heads the list


def test_a_finished_moco_run_can_still_export_its_backbone(trained_moco, tmp_path, capsys):
    """train_moco.py's docstring: --resume auto --export-backbone PATH on a finished run writes the
    backbone it ended with, then says the run is complete."""
    import torch

    run = shutil.copytree(trained_moco / "run", tmp_path / "run")  # the shared run folder is only read
    args = ["--device", "cpu", "--image-size", "16", "--batch-size", "32", "--moco-k", "256", "--max-steps", "5",
            "--knn-every", "0", "--resume", "auto", "--out", str(run),
            "--export-backbone", str(tmp_path / "backbone.pt")]
    proc = in_process(train_moco.main, args, capsys)
    assert proc.returncode == 0 and "is complete (step 5" in proc.stdout
    exported = torch.load(tmp_path / "backbone.pt", weights_only=True)
    at_the_end = torch.load(trained_moco / "backbone.pt", weights_only=True)  # exported when it finished
    assert exported.keys() == at_the_end.keys()
    assert all(torch.equal(exported[k], at_the_end[k]) for k in exported)
