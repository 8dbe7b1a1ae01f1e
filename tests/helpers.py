"""Shared test helpers: run the real CLIs in subprocesses or in this process, copy a run's
checkpoint into a new run folder, and run functions on N gloo ranks."""
from __future__ import annotations

import faulthandler
import importlib
import itertools
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ddp_utils.runtime.spawn import spawn_local

REPO = Path(__file__).resolve().parent.parent

TINY_DIGITS = ["--device", "cpu", "--dataset", "digits", "--arch", "small_cnn", "--image-size", "16",
               "--batch-size", "16", "--accum-steps", "2", "--log-every", "1"]
# 2 ranks x 16 x A=2: 22 optimizer steps per epoch of digits (719 images per rank)
STEPS_PER_EPOCH = 22
# The classifier: a cosine-epoch schedule with warm-up (its LR changes at the epoch boundary) and an
# EMA of the weights (updated every 3 optimizer steps, copying them during the warm-up)
CLASSIFIER_REF = TINY_DIGITS + ["--lr", "0.05", "--lr-schedule", "cosine-epoch", "--warmup-steps", "3",
                                "--epochs", "2", "--model-ema", "--model-ema-steps", "3", "--model-ema-decay", "0.999"]
# MoCo: the momentum schedule on, 30 steps (across the first epoch's end)
MOCO_REF = TINY_DIGITS + ["--moco-k", "200", "--moco-m-cos", "--epochs", "2", "--knn-every", "0",
                          "--max-steps", "30"]
# The symmetric loss: both crops' keys enqueued (2 x 64 per step into K = 200)
SYMMETRIC_REF = TINY_DIGITS + ["--moco-k", "200", "--symmetric", "--epochs", "1", "--knn-every", "0",
                               "--max-steps", "10"]


@dataclass
class Reference:
    """A finished 2-rank run with a checkpoint of every optimizer step."""

    script: str
    args: list[str]
    out: Path
    stdout: str
    checkpoints: dict[int, Path] = field(default_factory=dict)

    def checkpoint(self, step: int) -> Path:
        if not self.checkpoints:
            self.checkpoints = {load_ckpt(p)["step"]: p for p in self.out.glob("checkpoint_*.pt")}
        return self.checkpoints[step]

    @property
    def final(self) -> dict:
        return load_ckpt(self.out / "checkpoint_last.pt")


def assert_same_state(a: dict, b: dict) -> None:
    """Two checkpoints hold the same run state: weights, buffers, optimizer and the classifier's EMA
    of the weights (--model-ema), bit for bit."""
    assert (a["step"], a["epoch"], a["batches_done"]) == (b["step"], b["epoch"], b["batches_done"])
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    assert ("model_ema" in a) == ("model_ema" in b)
    for name, value in a.get("model_ema", {}).items():
        assert torch.equal(value, b["model_ema"][name]), f"EMA {name}"
    assert a["optimizer"]["param_groups"][0]["lr"] == b["optimizer"]["param_groups"][0]["lr"]
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without any launcher variables leaking into the child."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores: oversubscription would only slow tests
    env["PYTHONPATH"] = str(REPO)
    return {**env, **(extra or {})}


def run_cli(script: str, args: list[str], nproc: int = 1, timeout: float = 300,
            env: dict[str, str] | None = None, torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` for one process, ``torchrun --standalone`` for several."""
    if nproc == 1:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *torchrun_args, str(REPO / script), *args]
    return subprocess.run(cmd, cwd=REPO, env=cli_env(env), capture_output=True, text=True,
                          timeout=timeout)


def in_process(main: Callable[[list[str]], int], args: list[str], capsys) -> subprocess.CompletedProcess:
    """A script's ``main(args)`` called in this process (seconds faster than a subprocess), with
    stdout and stderr as the user would see them; an argparse or flag error's SystemExit is its
    exit code."""
    try:
        code = main(args)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def resume_folder(checkpoint: Path, out: Path) -> Path:
    """A new run folder holding a copy of ``checkpoint`` as its newest: ``--resume auto`` there
    continues from it."""
    out.mkdir(parents=True)
    shutil.copyfile(checkpoint, out / "checkpoint_last.pt")
    return out


def wait_until(condition: Callable[[], Any], timeout: float = 30.0) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (looked at 50 times a second)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


def load_ckpt(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


_next_port = itertools.count()


def free_port() -> int:
    """A port on 127.0.0.1 for a rendezvous (or a server) of this test process: each pytest-xdist
    worker hands out its own band of [20000, 32768), below Linux's ephemeral range, from which
    every ``bind(0)`` and gloo connection gets its port; so no other test process can take it
    between this choice and the bind. A port in use is passed over. Each process starts at its own
    place in its band (from its pid), so that two pytest sessions at once rarely meet."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    band = (32768 - 20000) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    while True:
        port = 20000 + worker * band + (os.getpid() * 97 + next(_next_port)) % band
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def _fork_like_torchrun() -> None:
    """A forkserver child inherits "forkserver" as its default start method; a torchrun worker
    has the platform's, fork, and so must a rank's DataLoader workers (through a server of their
    own, every pool of workers would start in seconds, not milliseconds)."""
    multiprocessing.set_start_method("fork", force=True)


def _rank_entry(rank: int, fn: Callable, out_dir: str, args: tuple) -> None:
    from ddp_utils.runtime.dist import cleanup_distributed, init_distributed

    _fork_like_torchrun()
    info = init_distributed("cpu", timeout_s=60)
    try:
        torch.save(fn(info, *args), Path(out_dir) / f"rank{rank}.pt")
    except BaseException as err:  # its frames' DDP models must not outlive the group
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        cleanup_distributed()


# What the forkserver imports once for the whole session: every rank forked from it starts with
# torch, torch._dynamo (which torch.optim imports: the largest part of a training process's
# start-up) and both scripts loaded, in well under a second, where a fresh interpreter spends
# about 5 s importing them. Set before the server starts; later calls change nothing.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "helpers", "train_classifier", "train_moco"]


def _forkserver() -> str:
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no-op once the server runs
    return "forkserver"


def run_on_ranks(fn: Callable, tmp_path: Path, *args: Any, world_size: int = 2) -> list[Any]:
    """Run ``fn(dist_info, *args)`` on ``world_size`` gloo ranks; returns each rank's result.

    ``fn`` must be importable (defined at module level) and return torch.save-able data.
    """
    spawn_local(_rank_entry, world_size, fn, str(tmp_path), args, start_method=_forkserver(), port=free_port())
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


STACKS_SIGNAL = signal.SIGUSR2  # no signal the scripts handle


def _main_entry(rank: int, world_size: int, port: int, script: str, args: list[str], env: dict[str, str],
                out_dir: str) -> None:
    """One rank of :func:`run_ranks`: the environment torchrun gives a worker, stdout and
    stderr into files, then the script's ``main(args)``; its return value is the exit code."""
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    _fork_like_torchrun()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        with open(Path(out_dir) / f"rank{rank}.{name}", "w") as f:
            os.dup2(f.fileno(), fd)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # run_ranks asks for the stacks of a rank it kills
    sys.argv = [str(REPO / script), *args]
    code = importlib.import_module(Path(script).stem).main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(script: str, args: list[str], tmp_path: Path, nproc: int = 2, timeout: float = 300,
              env: dict[str, str] | None = None, watch: Callable[[str], None] | None = None
              ) -> subprocess.CompletedProcess:
    """``main(args)`` of ``script`` on ``nproc`` gloo ranks, each a process forked from the
    session's forkserver with torchrun's environment variables: the scripts' own code from
    ``init_distributed`` on, without torchrun's agent or a fresh interpreter per rank (for the
    promises that are not about the launcher; those use :func:`run_cli`). ``returncode``: 0 when
    every rank exited 0, else the first rank's non-zero code (all of them in ``codes``); stdout
    and stderr: every rank's, in rank order. ``watch``: called with rank 0's stdout so far about
    ten times a second while the ranks run (to act on the network at a given step). A rank still
    running at ``timeout`` is killed, its threads' stacks written into its stderr first."""
    out = Path(tempfile.mkdtemp(dir=tmp_path, prefix="ranks-"))
    context = multiprocessing.get_context(_forkserver())
    port, child_env = free_port(), cli_env(env)
    ranks = [context.Process(target=_main_entry, args=(r, nproc, port, script, args, child_env, str(out)))
             for r in range(nproc)]
    for rank in ranks:
        rank.start()
    deadline = time.monotonic() + timeout
    while watch is not None and any(rank.is_alive() for rank in ranks) and time.monotonic() < deadline:
        ranks[0].join(0.1)
        if (out / "rank0.stdout").exists():
            watch((out / "rank0.stdout").read_text())
    for rank in ranks:
        rank.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank in ranks if rank.is_alive()]
    for rank in hung:  # where each one waits, into its stderr, before it goes
        os.kill(rank.pid, STACKS_SIGNAL)
    time.sleep(1 if hung else 0)
    for rank in hung:
        rank.kill()
        rank.join()
    codes = [rank.exitcode for rank in ranks]
    read = lambda name: "".join((out / f"rank{r}.{name}").read_text() for r in range(nproc))  # noqa: E731
    proc = subprocess.CompletedProcess(args, next((c for c in codes if c), 0), read("stdout"), read("stderr"))
    proc.codes = codes  # type: ignore[attr-defined]
    return proc


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a TensorBoard folder, read with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def write_image_folder(root: Path, per_class: int = 12) -> None:
    """A tiny ImageNet-layout tree made of digits (real images, written as PNG files)."""
    from PIL import Image

    from ddp_utils.data.sets import DigitsDataset

    digits = DigitsDataset(train=True)
    for split in ("train", "val"):
        for cls in range(3):
            (root / split / f"class{cls}").mkdir(parents=True)
        counts = {c: 0 for c in range(3)}
        for i in range(len(digits)):
            image, label = digits[i]
            if label < 3 and counts[label] < per_class:
                pixels = (image.permute(1, 2, 0) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / f"class{label}" / f"{i}.png")
                counts[label] += 1


def s3_error(status: int, code: str, headers: tuple[tuple[str, str], ...] = ()):
    """A rule's answer (``far_network.Rewrite``) as an S3 store words an error (no body at
    all for code "")."""
    from far_network import Rewrite

    body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>said by the proxy</Message>' \
           f'</Error>'.encode() if code else b""
    return Rewrite(status=status, answer=body, headers=(("Content-Type", "application/xml"), *headers))


@dataclass(frozen=True)
class Published:
    section: str
    gpus: int
    model: str
    argv: tuple[str, ...]  # the flags after train.py, $NAMEs filled in
    acc1: float            # torchvision's ImageNet-1K Acc@1
    recipe: str            # the recipe file written from the row (recipes/NAME.json), '' for none

    @property
    def name(self) -> str:
        return f"{self.section}:{self.model}"


def published_commands() -> list[Published]:
    """recipes/torchvision-commands.md's rows, one per model: torchvision's published commands."""
    commands = []
    for line in (REPO / "recipes" / "torchvision-commands.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith(("| section", "| ---")):
            continue
        section, gpus, command, models, recipe = (cell.strip() for cell in line.strip().strip("|").split("|"))
        for entry in models.split("; "):
            model, subs, acc1 = re.fullmatch(r"(\w+)(?: \(([^)]*)\))? ([\d.]+)", entry).groups()
            values = {"MODEL": model, **dict(kv.split("=") for kv in (subs or "").split())}
            argv = tuple(re.sub(r"\$(\w+)", lambda m: values[m.group(1)], token)
                         for token in shlex.split(command.strip("`")))
            commands.append(Published(section, int(gpus), model, argv, float(acc1),
                                      recipe.strip("`").removeprefix("recipes/").removesuffix(".json").strip("-")))
    return commands
