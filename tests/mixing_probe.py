"""train_classifier.py with each micro-batch's targets recorded before and after MixUp/CutMix, on
each rank (tests/test_reference_recipe.py runs it as the ranks of ``helpers.run_ranks``):
    mixing_probe.py RECORD ARGS...   ->   RECORD.rank<R>.pt: {(epoch, index): (labels, soft targets)}
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import train_classifier


def main(argv: list[str]) -> int:
    record, args = Path(argv[0]), argv[1:]
    real, seen = train_classifier.batch_mixer, {}

    def recording_mixer(cfg, num_classes, rank):
        mix = real(cfg, num_classes, rank)

        def spy(images, targets, epoch, index):
            mixed_images, mixed = mix(images, targets, epoch, index)
            seen[(epoch, index)] = (targets.clone(), mixed.clone())
            return mixed_images, mixed
        return spy

    train_classifier.batch_mixer = recording_mixer
    code = train_classifier.main(args)
    torch.save(seen, record.with_name(f"{record.name}.rank{os.environ.get('RANK', '0')}.pt"))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
