"""How a run stops: signals, the one agreement per optimizer step, and the exit codes.

Exit codes of both training scripts:

====  =====================================================================================
0     finished; or preempted (SIGUSR1/SIGTERM): checkpoint + ``PREEMPTED`` marker, requeue me
1     a crash, a lost peer, or a checkpoint that could not be written (the previous one is kept)
2     bad input: one line naming the fix, printed by rank 0, before any work
3     a non-finite (NaN/Inf) loss: that step was not applied; the last good checkpoint is kept
130   interrupted (Ctrl-C): the step in progress finished and a checkpoint was written
====  =====================================================================================

Signals only set a flag (I/O or collectives inside a handler can deadlock). After the last
backward of each optimizer step, and before ``optimizer.step()``, the ranks agree on three
numbers with *one* all_reduce: any rank signalled to stop (preemption), any rank interrupted,
how many ranks saw a non-finite loss in the window. Every rank therefore takes the same decision
after the same step: skip a non-finite step or stop on it, checkpoint and stop, or go on.
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
MARKER = "PREEMPTED"
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class RunStopped(Exception):
    """Raised on every rank at the same step; rank 0 logs ``message``; the process exits ``code``."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StopSignals:
    """SIGUSR1/SIGTERM (preemption) and SIGINT (Ctrl-C) handlers that only record what came.

    Ctrl-C before training starts, or a second Ctrl-C, raises KeyboardInterrupt at once; the first
    one during training asks for a checkpoint after the step in progress.
    """

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
        """Give the signals back to their previous handlers (the run is over)."""
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
    overflow: bool = False     # fp16: some gradient overflowed after unscaling (the scaler skips the step)

    @property
    def stop(self) -> bool:
        return self.preempted or self.interrupted


class StepGuard:
    """The per-step agreement: one all_reduce of four int32 and one device-to-host read.

    Kept cheap on a GPU: the non-finite flag is accumulated on the device over the window's
    micro-steps (no host sync per micro-step); the signal flags are written into a preallocated
    device tensor (a fill kernel, no copy from host memory); fp16's overflow flag comes from the
    unscaled gradients on the device; the four numbers travel in one collective; ``tolist()`` is
    the step's single host synchronisation, needed anyway because Python must branch on the
    answer before ``optimizer.step()``. With accumulation it happens once per ``accum_steps``
    micro-batches.
    """

    def __init__(self, signals: StopSignals | None, device: torch.device):
        self.signals = signals
        self.flags = torch.zeros(4, dtype=torch.int32, device=device)

    def __call__(self, nonfinite: torch.Tensor | None, overflow: torch.Tensor | None = None) -> StepVerdict:
        flags = self.flags
        flags.zero_()
        if self.signals is not None and self.signals.preempt_signal is not None:
            flags[0] = 1
        if self.signals is not None and self.signals.interrupted:
            flags[1] = 1
        if nonfinite is not None:
            flags[2].copy_(nonfinite)
        if overflow is not None:
            flags[3].copy_(overflow)
        preempted, interrupted, nonfinite_ranks, overflow_ranks = all_reduce_sum(flags).tolist()
        return StepVerdict(nonfinite_ranks, bool(preempted), bool(interrupted), bool(overflow_ranks))
