"""A training script run through ``main([script, *args])`` that writes, on each rank,
how many DistributedDataParallel models are alive when the process group is destroyed, into
``$TEARDOWN_PROBE_OUT/rank<r>.json`` (tests/test_run_safety.py)."""
from __future__ import annotations

import gc
import importlib
import json
import os
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main(args: list[str]) -> int:
    script, *script_args = args
    destroy = dist.destroy_process_group

    def counting_destroy(*pos, **kw):
        alive = sum(isinstance(obj, DistributedDataParallel) for obj in gc.get_objects())
        Path(os.environ["TEARDOWN_PROBE_OUT"], f"rank{dist.get_rank()}.json").write_text(json.dumps(alive))
        destroy(*pos, **kw)

    dist.destroy_process_group = counting_destroy  # cleanup_distributed looks it up when it runs
    return importlib.import_module(Path(script).stem).main(script_args)
