"""Never lose a run: protected run folders, checkpoint history, corrupt and hostile files, full
disks, elastic restarts, dead ranks, non-finite losses and Ctrl-C, through the real CLI."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    CLASSIFIER_REF,
    MOCO_REF,
    REPO,
    assert_ok,
    assert_same_state,
    cli_env,
    in_process,
    load_ckpt,
    read_scalars,
    resume_folder,
    run_on_ranks,
    run_ranks,
)

import train_classifier
import train_moco
from ddp_utils.config import UsageError
from ddp_utils.runtime.collectives import all_ranks_agree
from ddp_utils.runtime.dist import DistInfo
from ddp_utils.runtime.stopping import EXIT_NONFINITE, RunStopped
from ddp_utils.train import monitor
from ddp_utils.train.monitor import Progress
from ddp_utils.train.run import save_checkpoint, start_training
from ddp_utils.train.session import RunSession

LENET = ["--device", "cpu", "--arch", "lenet", "--batch-size", "16", "--log-every", "1"]


def _steps(tb: Path, tag: str = "train/loss") -> list[int]:
    return [step for step, _ in read_scalars(tb)[tag]]


@pytest.fixture
def classifier(capsys):
    """The classifier's CLI entry point, called in this process."""
    return lambda args: in_process(train_classifier.main, args, capsys)


@pytest.mark.parametrize("script, args, fault, codes", [
    ("train_moco.py", MOCO_REF + ["--max-steps", "4"], "", [0, 0]),  # the last --max-steps counts
    ("train_classifier.py", CLASSIFIER_REF + ["--max-steps", "4"], "nan:1:2", [3, 3]),
], ids=["moco ends", "classifier stops on a NaN"])
def test_no_ddp_model_outlives_the_process_group(script, args, fault, codes, tmp_path):
    """When a rank destroys its process group, no DDP model is alive: neither after a finished
    run nor after one that stops inside a step (the exception's frames hold the run). A DDP
    reducer left as the group's last holder destroys it later while holding the GIL, and gloo's
    destructor can then wait forever for a worker thread that needs the GIL (a rank that never
    exits; runtime.dist.cleanup_distributed)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    proc = run_ranks("teardown_probe.py", [script, *args, "--out", str(tmp_path / "run")], tmp_path,
                     env={"TEARDOWN_PROBE_OUT": str(probe), **({"DDP_FAULT": fault} if fault else {})})
    assert proc.codes == codes, proc.stdout + proc.stderr
    assert [json.loads((probe / f"rank{r}.json").read_text()) for r in range(2)] == [0, 0]


def test_a_run_that_raises_stops_its_device_batch_thread_before_it_returns(jpeg_folder, tmp_path, monkeypatch):
    """One process, image files augmented on the device, an error raised after step 1 (its
    traceback, still held here, holds the run and the thread's iterator): when main() has raised,
    the thread that makes batches ahead has stopped (the session closed the loaders), so that no
    CUDA work of it can run while the process tears down."""
    import threading

    from ddp_utils.data.files_on_device import THREAD_NAME

    monkeypatch.setenv("DDP_FAULT", "raise:0:1")
    before = {t for t in threading.enumerate() if t.name == THREAD_NAME}
    with pytest.raises(RuntimeError, match="injected fault") as raised:
        train_moco.main(["--dataset", "imagefolder", "--data-dir", str(jpeg_folder), "--aug-on", "device",
                         "--workers", "0", "--image-size", "32", "--batch-size", "4", "--bn-splits", "1", "--moco-k", "16",
                         "--knn-every", "0", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert raised.traceback  # held: the run's frames are alive
    assert {t for t in threading.enumerate() if t.name == THREAD_NAME} <= before


# ----------------------------------------------------------------------------- run folders
def test_overwrite_starts_over_and_never_mixes_two_runs(classifier, tmp_path):
    out = tmp_path / "run"
    assert_ok(classifier(LENET + ["--max-steps", "4", "--ckpt-every", "1", "--out", str(out)]))
    assert _steps(out / "tb") == [1, 2, 3, 4]
    again = classifier(LENET + ["--max-steps", "2", "--out", str(out)])
    assert again.returncode == 2 and "already holds a run (checkpoint_last.pt at step 4, in epoch 1)" in again.stderr
    assert "--resume auto" in again.stderr and "--overwrite" in again.stderr
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 4  # untouched
    fresh = classifier(LENET + ["--max-steps", "2", "--overwrite", "--out", str(out)])
    assert_ok(fresh)
    assert "--overwrite: removed checkpoint_last.pt, checkpoint_prev1.pt, tb, config.json" in fresh.stdout
    assert _steps(out / "tb") == [1, 2] and len(list((out / "tb").iterdir())) == 1  # one run's events
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 2
    assert not (out / "checkpoint_prev1.pt").exists()  # the old run's history went too


def test_checkpoint_history_rotates_and_prunes(classifier, tmp_path):
    out = tmp_path / "run"
    assert_ok(classifier(LENET + ["--max-steps", "4", "--ckpt-every", "1", "--keep-checkpoints", "3",
                                  "--out", str(out)]))
    steps = {p.name: load_ckpt(p)["step"] for p in out.glob("checkpoint*.pt")}
    assert steps == {"checkpoint_last.pt": 4, "checkpoint_prev1.pt": 3, "checkpoint_prev2.pt": 2}
    proc = classifier(LENET + ["--max-steps", "5", "--ckpt-every", "1", "--resume", "auto",
                               "--keep-checkpoints", "2", "--out", str(out)])
    assert_ok(proc)
    steps = {p.name: load_ckpt(p)["step"] for p in out.glob("checkpoint*.pt")}
    assert steps == {"checkpoint_last.pt": 5, "checkpoint_prev1.pt": 4}
    assert "resuming with changed settings: --max-steps 4 -> 5, --keep-checkpoints 3 -> 2" in proc.stdout
    assert not list(out.glob(".*.tmp"))


def test_resume_auto_passes_over_corrupt_and_hostile_files(classifier, tmp_path):
    """The newest checkpoint is truncated, the next one a pickle whose unpickling would run code:
    both are reported in one line each and the oldest readable one is used; the code never runs."""
    out = tmp_path / "run"
    assert_ok(classifier(LENET + ["--max-steps", "3", "--ckpt-every", "1", "--keep-checkpoints", "3",
                                  "--out", str(out)]))
    last = out / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[:4096])
    marker = tmp_path / "PWNED"
    torch.save({"model": _Evil(marker), "step": 2, "epoch": 0, "config": {}}, out / "checkpoint_prev1.pt")
    proc = classifier(LENET + ["--max-steps", "5", "--resume", "auto", "--out", str(out)])
    assert_ok(proc)
    assert ("checkpoint_last.pt is unreadable (truncated or not a PyTorch checkpoint (no complete zip "
            "archive)); resuming from the previous one at step 1") in proc.stdout
    assert "checkpoint_prev1.pt is unreadable (it holds a pickled Python object" in proc.stdout
    assert "resumed from" in proc.stdout and "checkpoint_prev2.pt: step 1" in proc.stdout
    assert not marker.exists()
    assert load_ckpt(last)["step"] == 5
    # Nothing readable left: one line, exit 2, and the folder is not touched.
    for path in out.glob("checkpoint*.pt"):
        path.write_bytes(b"")
    proc = classifier(LENET + ["--resume", "auto", "--out", str(out)])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--resume auto: no readable checkpoint in" in proc.stderr and "the file is empty" in proc.stderr


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_full_disk_at_save_time_keeps_the_previous_checkpoint(classifier, tmp_path):
    """The temp file is a link to /dev/full: every write fails with ENOSPC, as on a full disk."""
    out = tmp_path / "run"
    assert_ok(classifier(LENET + ["--max-steps", "2", "--out", str(out)]))
    before = (out / "checkpoint_last.pt").read_bytes()
    (out / ".checkpoint_last.pt.tmp").symlink_to("/dev/full")
    proc = classifier(LENET + ["--max-steps", "4", "--ckpt-every", "2", "--resume", "auto", "--out", str(out)])
    assert proc.returncode == 1
    assert (f"could not write the step-4 checkpoint in {out} (No space left on device); the previous "
            f"checkpoint {out}/checkpoint_last.pt is intact") in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (out / "checkpoint_last.pt").read_bytes() == before
    assert not (out / ".checkpoint_last.pt.tmp").exists()


def _limit_file_size(limit: int):
    """For a child process: any write past ``limit`` bytes of one file fails with EFBIG, the way a
    write fails on a full disk, midway through torch's own zip writer."""
    def set_limit():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return set_limit


def test_a_write_that_fails_inside_torch_names_the_system_reason(classifier, tmp_path):
    """torch's zip writer reports a failed write as its own RuntimeError naming a line of C++; the
    message gives the operating system's reason instead (here the file-size limit, on a full disk
    'No space left on device'), and the previous checkpoint stays."""
    out = tmp_path / "run"
    assert_ok(classifier(LENET + ["--max-steps", "2", "--out", str(out)]))
    before = (out / "checkpoint_last.pt").read_bytes()
    assert len(before) > 256 * 1024
    proc = subprocess.run([sys.executable, str(REPO / "train_classifier.py"), *LENET, "--max-steps", "4",
                           "--ckpt-every", "2", "--resume", "auto", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=cli_env(),
                          preexec_fn=_limit_file_size(256 * 1024))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (f"could not write the step-4 checkpoint in {out} (File too large); the previous "
            f"checkpoint {out}/checkpoint_last.pt is intact") in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (out / "checkpoint_last.pt").read_bytes() == before
    assert not (out / ".checkpoint_last.pt.tmp").exists()


def test_a_restarted_attempt_continues_instead_of_overwriting_again(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert train_classifier.main(LENET + ["--max-steps", "2", "--out", str(out)]) == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # as torchrun sets it in a restarted group
    assert train_classifier.main(LENET + ["--max-steps", "3", "--overwrite", "--out", str(out)]) == 0
    assert "restarted attempt: continuing from the newest checkpoint" in capsys.readouterr().out
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 3
    assert _steps(out / "tb") == [1, 2, 3]


# ----------------------------------------------------------------------------- agreement
def _agree_worker(info: DistInfo):
    try:
        with all_ranks_agree():
            if info.rank == 1:
                raise UsageError("--data-dir /x: missing on this node")
    except UsageError as err:
        return str(err)
    return None


def test_a_problem_on_one_rank_stops_every_rank(two_ranks):
    assert [rank["agreed"] for rank in two_ranks] == ["(rank 1) --data-dir /x: missing on this node"] * 2


# ----------------------------------------------------------------------------- workers that die
@pytest.mark.slow
@pytest.mark.torch_versions  # torchrun's elastic agent restarts the group
def test_elastic_restart_resumes_and_ends_like_an_uninterrupted_run(classifier_reference, tmp_path):
    """Rank 1 is killed (SIGKILL) after step 7; torchrun, started by launch/torchrun_local.sh with
    one restart allowed, restarts the group, which resumes from the step-6 checkpoint and ends at
    step 10 with the reference run's step-10 state, bit for bit."""
    out = tmp_path / "faulty"
    proc = subprocess.run(["bash", str(REPO / "launch/torchrun_local.sh"), "train_classifier.py", *CLASSIFIER_REF,
                           "--max-steps", "10", "--ckpt-every", "3", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=cli_env({"NPROC": "2", "MAX_RESTARTS": "1", "PYTHON": sys.executable,
                                       "DDP_FAULT": "kill:1:7"}))
    assert_ok(proc)
    assert "--check: ok" in proc.stdout  # the launcher's check, before any worker started
    for part in ("--standalone", "--nproc-per-node=2", "--max-restarts=1", "--resume if-restarted"):
        assert part in proc.stderr, part  # the printed command
    assert "lost contact with another rank" in proc.stdout  # rank 0, in the first attempt
    resumed = [line for line in proc.stdout.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "checkpoint_last.pt: step 6, in epoch 1" in resumed[0], proc.stdout
    assert_same_state(load_ckpt(out / "checkpoint_last.pt"), load_ckpt(classifier_reference.checkpoint(10)))
    assert _steps(out / "tb") == list(range(1, 11))  # the dead attempt's step 7 appears once


def test_a_rank_that_raises_takes_the_job_down_with_its_error_once(tmp_path):
    start = time.time()
    proc = run_ranks("train_classifier.py", LENET + ["--max-steps", "50", "--dist-timeout", "20",
                                                     "--out", str(tmp_path / "r")], tmp_path,
                     env={"DDP_FAULT": "raise:1:3"}, timeout=120)
    elapsed = time.time() - start
    text = proc.stdout + proc.stderr
    assert proc.codes == [1, 1], proc.codes
    assert text.count("RuntimeError: injected fault (DDP_FAULT) on rank 1 after step 3") == 1, text
    assert text.count("Traceback") == 1  # rank 1's; rank 0 says one line
    assert "rank 0 stops: lost contact with another rank" in text
    assert "step 50" not in text
    assert elapsed < 60, elapsed  # well under a hang; the collective timeout was 20 s


# ----------------------------------------------------------------------------- non-finite values
def test_a_nan_loss_on_one_rank_stops_or_is_skipped_on_every_rank(classifier_reference, tmp_path):
    """From the reference's step-4 checkpoint, rank 1's loss of step 5 is NaN. Without
    --skip-nonfinite both ranks stop with exit code 3 and the step-4 checkpoint stays; with
    --skip-nonfinite 1 the step is dropped on both ranks: weights and momentum buffers stay
    exactly those of step 4 (BatchNorm's running statistics saw the step's forward passes)."""
    step4 = classifier_reference.checkpoint(4)
    out = resume_folder(step4, tmp_path / "stop")
    proc = run_ranks("train_classifier.py", CLASSIFIER_REF + ["--max-steps", "8", "--resume", "auto", "--out", str(out)],
                     tmp_path, env={"DDP_FAULT": "nan:1:5"})
    assert proc.codes == [3, 3]
    message = (f"step 5: the loss was NaN or Inf on 1 of 2 rank(s); that step was not applied and the run "
               f"stops; the last good checkpoint is {out}/checkpoint_last.pt (step 4)")
    assert proc.stdout.count(message) == 1, proc.stdout
    assert (out / "checkpoint_last.pt").read_bytes() == step4.read_bytes()
    assert _steps(out / "tb") == [5]  # the stopping step is logged (its loss is NaN)

    out = resume_folder(step4, tmp_path / "skip")
    proc = run_ranks("train_classifier.py", CLASSIFIER_REF + ["--max-steps", "5", "--skip-nonfinite", "1",
                                                              "--resume", "auto", "--out", str(out)],
                     tmp_path, env={"DDP_FAULT": "nan:1:5"})
    assert_ok(proc)
    assert "step 5: NaN/Inf loss on 1 of 2 rank(s); step skipped (1 of --skip-nonfinite 1)" in proc.stdout
    assert "weights identical on all 2 ranks" in proc.stdout
    skipped, before = load_ckpt(out / "checkpoint_last.pt"), load_ckpt(step4)
    assert skipped["step"] == 5 and skipped["nonfinite_skipped"] == 1
    buffers = ("running_mean", "running_var", "num_batches_tracked")  # the step's forward passes did run
    weights = [name for name in before["model"] if not name.endswith(buffers)]
    assert len(weights) == 14  # 4 conv-BN blocks (conv weight, BN weight and bias) and fc
    for name in weights:
        assert torch.equal(before["model"][name], skipped["model"][name]), name
    for key, state in before["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], skipped["optimizer"]["state"][key]["momentum_buffer"])


def _moco_skip_worker(info: DistInfo, tmp_dir: str, monkeypatch_env: dict):
    import os

    os.environ.update(monkeypatch_env)  # rank 1's loss of step 2 is NaN
    cfg = train_moco.MocoConfig(dataset="digits", arch="small_cnn", image_size=16, batch_size=8, moco_k=64,
                                device="cpu", knn_every=0, epochs=1, skip_nonfinite=1, log_every=1000, out=tmp_dir)

    def snapshot(m):
        return [t.clone() for t in (*m.encoder_q.parameters(), *m.encoder_k.parameters(), m.queue, m.queue_ptr)]

    with RunSession(cfg) as session:
        run = train_moco.setup(cfg, session)
        meter = start_training(run)
        states = []
        for steps in (1, 2, 3):
            run.cfg.max_steps = steps
            train_moco.train_one_epoch(run, meter)
            states.append(snapshot(run.moco))
    return {"unchanged_by_skip": all(torch.equal(a, b) for a, b in zip(states[0], states[1])),
            "moved_after": not all(torch.equal(a, b) for a, b in zip(states[1], states[2])),
            "ptr": int(run.moco.queue_ptr), "skipped": run.state.nonfinite_skipped}


def _two_ranks_worker(info: DistInfo, tmp_dir: str) -> dict:
    """Both 2-rank scenarios of this file in one job."""
    return {"agreed": _agree_worker(info), "skip": _moco_skip_worker(info, tmp_dir, {"DDP_FAULT": "nan:1:2"})}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("two_ranks")
    return run_on_ranks(_two_ranks_worker, tmp, str(tmp / "run"))


def test_moco_skips_a_nonfinite_step_without_touching_encoders_or_queue(two_ranks):
    for result in (rank["skip"] for rank in two_ranks):
        assert result["unchanged_by_skip"] and result["moved_after"]
        assert result["ptr"] == (2 * 2 * 8) % 64 and result["skipped"] == 1  # 2 of 3 steps enqueued


def test_non_finite_weights_are_never_written(tmp_path):
    cfg = train_classifier.ClassifierConfig(arch="lenet", device="cpu", out=str(tmp_path / "run"))
    with RunSession(cfg) as session:
        run = train_classifier.setup(cfg, session)
        before = sorted(p.name for p in (tmp_path / "run").iterdir())
        run.state.step = 7
        next(run.model.parameters()).data[0] = float("inf")
        with pytest.raises(RunStopped, match="step 7: the weights are NaN or Inf, so no checkpoint was written") as stop:
            save_checkpoint(run)
        assert stop.value.code == EXIT_NONFINITE
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before == ["config.json", "tb"]


# ----------------------------------------------------------------------------- Ctrl-C
def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "train_classifier.py"), *args], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{text!r} never appeared; exit {proc.poll()}: {proc.stderr.read()}")


def test_first_ctrl_c_finishes_the_step_and_checkpoints(tmp_path):
    out = tmp_path / "run"
    proc = _start(LENET + ["--epochs", "50", "--out", str(out)])
    _wait_for_line(proc, "step 3/")
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest + err
    assert "interrupt: finishing this optimizer step and writing a checkpoint" in err
    stopped = load_ckpt(out / "checkpoint_last.pt")["step"]
    assert f"interrupted at step {stopped}: checkpoint written in {out}; continue with the same command " \
           f"plus --resume auto" in rest
    assert "Traceback" not in rest + err


def test_second_ctrl_c_exits_at_once(tmp_path):
    out = tmp_path / "run"
    proc = _start(["--device", "cpu", "--arch", "resnet18", "--batch-size", "64", "--log-every", "1",
                   "--out", str(out)])  # about a second per step on one core
    _wait_for_line(proc, "step 1/")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    start = time.time()
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, rest + err
    assert "interrupted: stopped at once without a new checkpoint; no checkpoint was written yet" in err
    assert "Traceback" not in rest + err
    assert time.time() - start < 10
    assert not (out / "checkpoint_last.pt").exists()


# ----------------------------------------------------------------------------- logs
def test_the_last_step_is_logged_and_epochs_are_counted_once(classifier, tmp_path):
    """--max-steps between two --log-every points, a run shorter than --log-every, and a periodic
    checkpoint that falls on the epoch's last step (22 steps of 64 make an epoch of digits)."""
    out = tmp_path / "run"
    proc = classifier(["--device", "cpu", "--arch", "lenet", "--log-every", "10",
                                           "--ckpt-every", "11", "--max-steps", "25", "--out", str(out)])
    assert_ok(proc)
    assert _steps(out / "tb") == [10, 20, 25]
    assert proc.stdout.count("saved checkpoint") == 3  # steps 11, 22 (once, though both rules apply), 25
    assert "saved checkpoint" in proc.stdout and "(step 22, end of epoch 1)" in proc.stdout
    assert "epoch 1 step 22: val loss" in proc.stdout and "epoch 2 step 25: val loss" in proc.stdout
    assert "identical on all" not in proc.stdout  # one process: nothing to compare
    short = tmp_path / "short"
    assert_ok(classifier(LENET + ["--log-every", "20", "--max-steps", "3", "--out", str(short)]))
    assert _steps(short / "tb") == [3]


def test_the_first_progress_line_has_an_eta(monkeypatch, caplog):
    clock = iter([100.0, 103.0])  # the meter is made at t=100; step 1 ends 3 s later
    monkeypatch.setattr(monitor.time, "perf_counter", lambda: next(clock))
    progress = Progress(total_steps=101, epochs=5, enabled=True)
    with caplog.at_level("INFO", logger="train"):
        progress.update(1, 1, loss=2.3, lr=0.1, images_per_sec=64.0)
    assert "epoch 1/5 step 1/101" in caplog.text and "eta 0:05:00" in caplog.text


def test_restarts_on_the_shared_store_are_warned_about(monkeypatch, caplog):
    from ddp_utils.train.session import warn_if_restarts_can_hang

    info = DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo", "torchrun")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    with caplog.at_level("WARNING", logger="train"):
        warn_if_restarts_can_hang(info)
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as launch/restarts.sh sets it
        warn_if_restarts_can_hang(info)
    assert caplog.text.count("without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") == 1
