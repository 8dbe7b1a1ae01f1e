"""Several benchmarks' command lines run one after another in one interpreter, for
tests/test_benches.py:

    python tests/run_benches.py "knn.py --bank 64 --rounds 1" "augment.py --repeats 1" ...

Each argument is a bench/ file and its flags; its ``main(argv)`` is called, its output (stdout and
stderr, its ranks' included) printed between ``==> bench/NAME ARGS`` and ``<== exit CODE``, a
traceback in between if it raised. Torch is imported once here, and the benches that start ranks
(``spawn_local(..., start_method="forkserver")``) fork them from one server that imported torch
and the package once: a bench costs its own work, not a fresh interpreter per rank. Exits 0 even
when a bench fails: the caller reads each one's code.
"""
from __future__ import annotations

import importlib
import multiprocessing
import shlex
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What the forkserver imports once: what the ranks' workers need, so that each starts in well under a second
PRELOAD = ["torch", "torch.distributed", "torchvision", "ddp_utils.runtime.dist", "ddp_utils.runtime.collectives",
           "ddp_utils.models.backbones", "ddp_utils.models.moco", "train_classifier"]


def run(command: str) -> int:
    """One bench's ``main(argv)``; its exit code (1 for an exception, whose traceback is printed)."""
    name, *argv = shlex.split(command)
    try:
        code = importlib.import_module(f"bench.{Path(name).stem}").main(argv)
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        code = 1
    return code or 0


def main(commands: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    multiprocessing.set_forkserver_preload(PRELOAD)
    for command in commands:
        print(f"==> bench/{command}", flush=True)
        code = run(command)
        sys.stderr.flush()
        print(f"<== exit {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
