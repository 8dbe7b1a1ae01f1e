"""The life of one training process, as a context manager around ``setup`` and ``fit``::

    cfg = parse_args(Config, argv, __doc__)
    with RunSession(cfg) as session:   # signals, process group, logging, exit code, clean-up
        fit(setup(cfg, session))
    return session.exit_code

Every way a run can end becomes one exit code (``runtime.stopping.EXIT_CODES``), said once. The
session also sets the process-wide switches of the GPU fast path (:func:`configure_backends`:
TF32, cuDNN's autotuner; on the CPU only what changes nothing numerically).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import traceback
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Callable

import torch
import torch.distributed as dist

from ..config import UsageError
from ..data.pipeline import Loaders
from ..runtime.collectives import all_gather_object
from ..runtime.dist import DistInfo, cleanup_distributed, init_distributed
from ..runtime.faults import FaultPlan
from ..runtime.launch import detect_launch, node_name
from ..runtime.logs import masked, release_held_logs, say_error, setup_logging
from ..runtime.precision import precision_name
from ..runtime.stopping import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STORE,
    EXIT_USAGE,
    STORE_MARKER,
    RunStopped,
    StepGuard,
    StepVerdict,
    StopSignals,
)
from .train_config import TrainConfig

log = logging.getLogger("train")

# What a collective raises when a peer died or stopped answering (gloo's and NCCL's own words);
# anything else, a size mismatch or an out-of-memory inside NCCL included, is this rank's error.
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Timed out waiting \d+ms|"
                        r"collective operation timeout|remote process exited|communicator was aborted")


@dataclass
class SavedCheckpoint:
    """The newest checkpoint this process wrote or resumed from: what a failure message names."""

    step: int | None = None
    path: Path | None = None

    def describe(self) -> str:
        if self.path is None:
            return "no checkpoint was written yet"
        return f"the last good checkpoint is {self.path} (step {self.step})"


class RunSession:
    """Owns, for one run: the stop signals, the process group, rank-0 logging, the per-step
    agreement, the exit code and the clean-up. Bad input (:class:`UsageError`) anywhere inside
    ends as one line on rank 0 and exit code 2; a crash of a distributed run as its traceback on
    the rank that failed and one line on the others, exit code 1."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.exit_code = EXIT_OK
        self.saved = SavedCheckpoint()  # what a failure message names
        self.faults = FaultPlan()  # the pre-flight reads DDP_FAULT (train.preflight)
        self._closing = contextlib.ExitStack()

    def __enter__(self) -> RunSession:
        cfg = self.cfg
        self.reporter = detect_launch().rank == 0  # the one process that prints bad-input errors
        self.signals = StopSignals(cfg.out, announce=self.reporter)  # before the rendezvous: a USR1 then must not kill us
        self._closing.callback(self.signals.close)
        try:
            self.info: DistInfo = init_distributed(cfg.device, cfg.dist_timeout)
            setup_logging(self.info.rank, cfg.debug, hold=True)  # shown once the start has succeeded
            self._closing.callback(configure_backends(self.info.device, cfg.tf32, cfg.deterministic))
            self._step_guard = StepGuard(self.signals, self.info.device)
        except BaseException:
            self._close()
            raise
        log.info("%s launch: world size %d, backend %s, device %s, precision %s%s", self.info.launcher,
                 self.info.world_size, self.info.backend or "none", self.info.device,
                 precision_name(cfg.amp, self.info.device), ", compiled" if cfg.compile else "")
        if self.info.is_distributed:
            log_placement(self.info)
        warn_if_restarts_can_hang(self.info)
        self._closing.callback(torch.autograd.set_detect_anomaly, torch.is_anomaly_enabled())  # as it was
        torch.autograd.set_detect_anomaly(cfg.debug)
        if cfg.debug:
            log.info("--debug: autograd anomaly detection on, small data subsets, extra checks after every step")
        return self

    def agree_on_step(self, nonfinite: torch.Tensor, overflow: torch.Tensor | None = None,
                      give_up: bool = False) -> StepVerdict:
        """The ranks' one agreement per optimizer step (every rank calls): a NaN/Inf loss, an
        fp16 overflow, a stop signal or a rank giving up the window (``give_up``: its data could
        not be read), in one all-reduce and one device read (:class:`StepGuard`)."""
        return self._step_guard(nonfinite, overflow, give_up)

    def close_at_exit(self, resource):
        """``resource.close()`` when the session ends, however it ends; returns ``resource``."""
        self._closing.callback(resource.close)
        return resource

    def close_loaders_at_exit(self, loaders: Loaders) -> Loaders:
        """``loaders.close()`` when the session ends, told whether the run stopped to be started
        again (any exit but a finished run's or bad input's: the store, a preemption, a failure
        that torchrun restarts), whose next attempt keeps the node's cache of shards."""
        self._closing.callback(lambda: loaders.close(restartable=self.exit_code not in (EXIT_OK, EXIT_USAGE)))
        return loaders

    def __exit__(self, kind, err: BaseException | None, tb: TracebackType | None) -> bool:
        try:
            return self._end(err)
        finally:
            if tb is not None and self.info.is_distributed:  # one process keeps them for a debugger
                traceback.clear_frames(tb)  # their run (its DDP model) must not outlive the group
            self._close()

    def _end(self, err: BaseException | None) -> bool:
        """Sets the exit code; True when ``err`` has been reported and must not propagate."""
        if err is None:
            return False
        if isinstance(err, UsageError):
            release_held_logs(show=False)  # the error line says it all
            if self.reporter and not err.said:
                say_error(f"{Path(sys.argv[0]).name}: error: {err}")
            self.exit_code = err.exit_code
            self._mark_store_fault(err)
            return True
        if isinstance(err, RunStopped):
            if self.reporter:
                {EXIT_OK: log.info, EXIT_INTERRUPTED: log.warning}.get(err.code, log.error)("%s", err)
            self.exit_code = err.code
            self._mark_store_fault(err)
            return True
        if isinstance(err, KeyboardInterrupt):
            if self.reporter:
                print(f"{Path(sys.argv[0]).name}: interrupted: stopped at once without a new checkpoint; "
                      f"{self.saved.describe()}", file=sys.stderr, flush=True)
            if self.info.is_distributed:
                self._leave(EXIT_INTERRUPTED)  # peers may be inside a collective: no group teardown
            self.exit_code = EXIT_INTERRUPTED
            return True
        if not isinstance(err, Exception) or not self.info.is_distributed:
            return False  # one process: the ordinary traceback is the clearest report of a bug
        release_held_logs(show=True)
        if lost_a_peer(err):
            brief = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip().splitlines()[0] if str(err).strip() else "")
            log.error("rank %d stops: lost contact with another rank (%s); that rank's own error is shown "
                      "above or in its log", self.info.rank, brief.split(". ")[0] or type(err).__name__)
        else:
            log.error("rank %d failed:", self.info.rank, exc_info=err)
        self._leave(EXIT_FAILURE)

    def _mark_store_fault(self, err: Exception) -> None:
        """Rank 0, a run (or a restarted attempt) that stops for the object store: the reason in
        ``OUT/STORE_UNAVAILABLE``, where the SLURM script looks for it to requeue the job (a
        fresh run's folder is left alone: nothing is written there before its start)."""
        out = Path(self.cfg.out)
        if self.exit_code == EXIT_STORE and self.reporter and out.is_dir():
            (out / STORE_MARKER).write_text(masked(f"{datetime.now().isoformat(timespec='seconds')}\t{err}\n"))

    def _leave(self, code: int) -> None:
        """Leave at once: tearing down a process group whose peer may be dead can abort the
        process (gloo: "terminate called without an active exception")."""
        self.exit_code = code
        self._closing.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _close(self) -> None:
        release_held_logs(show=True)
        self._closing.close()
        cleanup_distributed()


def lost_a_peer(err: BaseException) -> bool:
    """Whether a collective failed because another rank died or stopped answering."""
    lost = tuple(getattr(dist, name) for name in ("DistNetworkError", "DistStoreError") if hasattr(dist, name))
    return isinstance(err, lost) or bool(_PEER_LOST.search(str(err)))


def log_placement(info: DistInfo) -> None:
    """One line on rank 0: which node runs which ranks (every rank calls: one all_gather)."""
    nodes = all_gather_object(node_name())
    ranks: dict[str, list[str]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(str(rank))
    if info.is_main:
        log.info("ranks by node: %s", "; ".join(f"{node}: {', '.join(r)}" for node, r in ranks.items()))


def warn_if_restarts_can_hang(info: DistInfo) -> None:
    """torchrun shares its rendezvous store with the workers unless told not to; a restarted
    group can then read the dead group's addresses and hang at start-up (pytorch/pytorch#135712)."""
    if info.is_main and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) and \
            os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        log.warning("torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted "
                    "group can hang at start-up (pytorch/pytorch#135712); set it in torchrun's "
                    "environment (launch/*.sh do)")


def configure_backends(device: torch.device, tf32: bool = True, deterministic: bool = False) -> Callable[[], None]:
    """Process-wide switches: on CUDA TF32 and cuDNN's autotuner (every training batch has the
    same shape), unless ``deterministic``, which also makes PyTorch use (or demand) deterministic
    kernels on every device. Returns a function that puts the previous switches back."""
    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (torch.are_deterministic_algorithms_enabled(), cuda.allow_tf32, cudnn.allow_tf32, cudnn.benchmark,
              cudnn.deterministic)

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0])
        cuda.allow_tf32, cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic = before[1:]

    if deterministic:
        # cuBLAS repeats its results only with a fixed workspace; read when its handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        cuda.allow_tf32 = cudnn.allow_tf32 = tf32 and not deterministic
        cudnn.benchmark = not deterministic
        cudnn.deterministic = deterministic
    return restore
