"""Fault injection for the tests (and for anyone checking their cluster's restart path).

``DDP_FAULT="KIND:RANK:STEP[,KIND:RANK:STEP...]"`` makes rank RANK misbehave at optimizer step
STEP, only in the first attempt of a job (torchrun restart count and SLURM requeue count 0), so a
restarted job runs clean:

* ``kill``  after step STEP, the process kills itself with SIGKILL (like ``kill -9`` of a worker);
* ``raise`` after step STEP, the process raises RuntimeError("injected fault ...");
* ``nan``   the loss of step STEP (its first micro-batch) becomes NaN on that rank.

Unset (the normal case) every hook is a no-op.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Mapping

import torch

from ..config import UsageError
from .dist import restart_count

ENV = "DDP_FAULT"
KINDS = ("kill", "raise", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


class FaultPlan:
    def __init__(self, faults: tuple[Fault, ...] = ()):
        self.faults = faults

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "FaultPlan":
        env = os.environ if env is None else env
        text = env.get(ENV, "").strip()
        if not text or restart_count(env) > 0:
            return cls()
        faults = []
        for part in text.split(","):
            kind, _, rest = part.strip().partition(":")
            rank, _, step = rest.partition(":")
            if kind not in KINDS or not rank.isdigit() or not step.isdigit():
                raise UsageError(f"{ENV}={text!r}: expected KIND:RANK:STEP with KIND one of "
                                 f"{', '.join(KINDS)}, e.g. kill:1:7")
            faults.append(Fault(kind, int(rank), int(step)))
        return cls(tuple(faults))

    def _planned(self, kind: str, rank: int, step: int) -> bool:
        return Fault(kind, rank, step) in self.faults

    def poison(self, loss: torch.Tensor, rank: int, step: int, first_micro: bool) -> torch.Tensor:
        """The loss, or NaN where a ``nan`` fault is planned for this rank and step."""
        if first_micro and self._planned("nan", rank, step):
            return loss * float("nan")
        return loss

    def after_step(self, rank: int, step: int) -> None:
        if self._planned("kill", rank, step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._planned("raise", rank, step):
            raise RuntimeError(f"injected fault ({ENV}) on rank {rank} after step {step}")
