"""How a run stops: signals, the one agreement of all ranks per optimizer step, and exit codes.

Signal handlers only record what came (I/O or collectives inside a handler can deadlock). After
the last backward of each optimizer step, before ``optimizer.step()``, the ranks agree with one
all_reduce (:class:`StepGuard`), so every rank takes the same decision after the same step.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

from .collectives import all_reduce_sum

log = logging.getLogger("train")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NONFINITE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_STORE = 75  # sysexits.h's EX_TEMPFAIL: a fault outside the run that a later attempt may not meet
# code: (when, what is on disk afterwards); README's table is generated from it
EXIT_CODES = {
    EXIT_OK: ("finished; or preempted (SIGUSR1/SIGTERM)",
              "a checkpoint of the last step; `PREEMPTED` when preempted (the SLURM script requeues)"),
    EXIT_FAILURE: ("a crash, a lost peer, a checkpoint that could not be written",
                   "the previous checkpoints, untouched"),
    EXIT_USAGE: ("bad input: one line naming the fix, before any work; or, met during the run, an image file that "
                 "cannot be decoded, or an object store's fault no restart fixes (a shard changed or removed, access "
                 "refused, no such bucket, credentials that stay expired, a store that rejects If-Match, a full "
                 "cache disk)",
                 "nothing new; for what was met during the run, a checkpoint of the last completed step (and for a "
                 "file or a shard, `UNREADABLE`)"),
    EXIT_NONFINITE: ("a NaN or Inf loss (beyond `--skip-nonfinite`), or weights that became NaN or Inf",
                     "the last good checkpoint; the bad step was not applied"),
    EXIT_STORE: ("the object store (`--data-dir s3://...`) did not answer for `--store-timeout` seconds (unreachable, "
                 "throttling, server errors, a shard still not all there), during the run or at a restarted attempt's "
                 "start",
                 "a checkpoint of the last completed step and `STORE_UNAVAILABLE`; torchrun's `--max-restarts` and the "
                 "SLURM script (a requeue) start the job again, which waits for the store, then resumes"),
    EXIT_INTERRUPTED: ("Ctrl-C", "the first Ctrl-C during training: a checkpoint of the optimizer step in "
                       "progress, which finishes; a second Ctrl-C, or one before training starts: nothing new"),
}
MARKER = "PREEMPTED"
STORE_MARKER = "STORE_UNAVAILABLE"  # OUT's record of a run that stopped on the object store (the SLURM script requeues)
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class RunStopped(Exception):
    """Raised on every rank at the same step; rank 0 logs ``message``; the process exits ``code``."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StopSignals:
    """SIGUSR1/SIGTERM (preemption) and SIGINT (Ctrl-C) handlers that only record what came.
    Ctrl-C before training starts, or a second one, raises KeyboardInterrupt at once."""

    def __init__(self, out_dir: str | Path, announce: bool):
        self.marker = Path(out_dir) / MARKER
        self.announce = announce  # rank 0 says once that the interrupt was heard
        self.preempt_signal: int | None = None
        self.interrupted = False
        self.training = False
        self._previous = {sig: signal.signal(sig, self._on_preempt) for sig in PREEMPT_SIGNALS}
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

    def training_started(self) -> None:
        self.training = True

    def close(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_preempt(self, signum: int, frame) -> None:
        if self.preempt_signal is None:
            self.preempt_signal = signum  # nothing else here: act at the next step boundary

    def _on_interrupt(self, signum: int, frame) -> None:
        if not self.training or self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        if self.announce:  # os.write: print() is not safe inside a signal handler
            os.write(2, b"\ninterrupt: finishing this optimizer step and writing a checkpoint; "
                        b"press Ctrl-C again to quit at once without one\n")

    def write_marker(self, step: int) -> None:
        """Rank 0, after the checkpoint: tells the launch script to requeue."""
        name = signal.Signals(self.preempt_signal).name if self.preempt_signal else "a peer's signal"
        self.marker.write_text(f"step {step}\n")
        log.warning("preempted (%s): checkpoint written at step %d; exiting for requeue", name, step)

    def clear_marker(self) -> None:
        self.marker.unlink(missing_ok=True)


@dataclass(frozen=True)
class StepVerdict:
    """What all ranks agreed on after the last backward of an optimizer step."""

    nonfinite_ranks: int = 0   # ranks whose loss was NaN or Inf in this window
    preempted: bool = False    # a rank received SIGUSR1/SIGTERM
    interrupted: bool = False  # a rank received Ctrl-C
    overflow: bool = False     # fp16: a gradient overflowed after unscaling (the step is skipped)
    given_up_ranks: int = 0    # ranks that cannot train on this window (it is undone on every rank)

    @property
    def stop(self) -> bool:
        return self.preempted or self.interrupted

    @property
    def may_step(self) -> bool:
        """The weights may move: no rank's loss was NaN or Inf and no fp16 gradient overflowed."""
        return not self.nonfinite_ranks and not self.overflow


class StepGuard:
    """The per-step agreement: one all_reduce of five int32 and one device-to-host read, the
    optimizer step's only one (Python must branch on it before ``optimizer.step()``). The flags
    are written on the device; the non-finite and overflow flags are computed there."""

    def __init__(self, signals: StopSignals | None, device: torch.device):
        self.signals = signals
        self.flags = torch.zeros(5, dtype=torch.int32, device=device)

    def __call__(self, nonfinite: torch.Tensor, overflow: torch.Tensor | None = None,
                 give_up: bool = False) -> StepVerdict:
        """``give_up``: this rank cannot train on this window (e.g. its data could not be read)."""
        flags = self.flags
        flags.zero_()
        if self.signals is not None and self.signals.preempt_signal is not None:
            flags[0].fill_(1)  # a fill kernel: assigning a Python 1 would copy from the host
        if self.signals is not None and self.signals.interrupted:
            flags[1].fill_(1)
        flags[2].copy_(nonfinite)
        if overflow is not None:
            flags[3].copy_(overflow)
        if give_up:
            flags[4].fill_(1)
        preempted, interrupted, nonfinite_ranks, overflow_ranks, given_up_ranks = all_reduce_sum(flags).tolist()
        return StepVerdict(nonfinite_ranks, bool(preempted), bool(interrupted), bool(overflow_ranks),
                           given_up_ranks)
