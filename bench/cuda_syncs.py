"""CUDA synchronisations per optimizer step of a real training run, as the GPU reports them.

    python bench/cuda_syncs.py --warmup-steps 5 train_moco.py --max-steps 30 ...

Runs the script's ``main()`` in this process. After ``--warmup-steps`` optimizer steps (first-call
allocations, cuDNN autotuning) it calls ``torch.cuda.set_sync_debug_mode("warn")``: from then on
PyTorch warns at every operation that makes the host wait for the GPU (``item``, ``tolist``,
``nonzero``, blocking copies, ...). The warnings are counted per optimizer step, from one step's
end to the next one's, and printed as one line: how many steps made how many syncs. The
training loop's budget is one per step (the ranks' agreement); a kNN pass or a checkpoint
between two steps shows as a step with more. Without CUDA the run goes as it is and the count
is "n/a".
"""
from __future__ import annotations

import argparse
import collections
import importlib
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def after_each_step(script, callback) -> None:
    """Calls ``callback(run)`` after each optimizer step of the training script module
    ``script``, once the step is counted: its loop calls ``ends_the_run`` then, once per step."""
    ends_the_run = script.ends_the_run

    def hooked(run, verdict):
        callback(run)
        return ends_the_run(run, verdict)

    script.ends_the_run = hooked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup-steps", type=int, default=5, help="optimizer steps before counting starts")
    parser.add_argument("script", choices=("train_classifier.py", "train_moco.py"))
    args, script_args = parser.parse_known_args(argv)
    module = importlib.import_module(Path(args.script).stem)
    if not torch.cuda.is_available():  # the run as it is, nothing to count
        code = module.main(script_args)
        print("CUDA syncs per optimizer step: n/a (no CUDA on this machine)")
        return code
    syncs, per_step = [0], []  # syncs since the last step's end; one entry per counted step
    counting = [False]

    def count(message, category, *rest):
        if counting[0] and "synchroniz" in str(message):
            syncs[0] += 1

    def count_after_a_step(run):
        if counting[0]:
            per_step.append(syncs[0])
        elif run.state.step >= args.warmup_steps:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            counting[0] = True
        syncs[0] = 0

    after_each_step(module, count_after_a_step)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = count
        code = module.main(script_args)
    torch.cuda.set_sync_debug_mode("default")
    histogram = collections.Counter(per_step)
    spread = ", ".join(f"{n} sync(s) in {steps} step(s)" for n, steps in sorted(histogram.items()))
    print(f"CUDA syncs per optimizer step: {spread or 'no step counted'} (of {len(per_step)} steps after "
          f"{args.warmup_steps} warm-up steps)")
    return code


if __name__ == "__main__":
    sys.exit(main())
