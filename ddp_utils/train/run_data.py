"""The run's data from its config: the plan ``data.pipeline.build_data`` takes, this rank's
batches, the raw splits (for ``--check``), and the picture of the augmentation."""
from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from ..data.pipeline import DataPlan, Loaders, build_data
from ..data.preview import augmentation_grid
from ..data.recipes import AugmentRecipe
from ..data.sets import load_raw_splits
from ..runtime.dist import DistInfo
from .checkpoint import Resume
from .train_config import TrainConfig


def data_plan(cfg: TrainConfig, resolved: dict[str, Any], recipe: AugmentRecipe,
              bank_samples: int | None = None) -> DataPlan:
    """The run's data, as ``data.pipeline.build_data`` takes it: the flags with what the "auto"
    ones resolved to, the script's training view (``recipe``, ``cfg.VIEWS`` per sample) and MoCo's
    kNN bank (``bank_samples``; None: no bank)."""
    return DataPlan(dataset=cfg.dataset, data_dir=cfg.data_dir, image_size=resolved["image_size"],
                    synthetic_samples=cfg.synthetic_samples, debug=cfg.debug, seed=cfg.seed, batch_size=cfg.batch_size,
                    workers=resolved["workers"], normalization=cfg.normalization, recipe=recipe, views=cfg.VIEWS,
                    aug_on_device=resolved["aug_on"] == "device", decode_on_device=resolved["decode_on"] == "device",
                    bank_samples=bank_samples)


def build_run_data(cfg: TrainConfig, info: DistInfo, resolved: dict[str, Any], recipe: AugmentRecipe,
                   bank_samples: int | None = None) -> Loaders:
    """This rank's batches of the run (:func:`data_plan`'s arguments; ``data.pipeline.build_data``)."""
    return build_data(data_plan(cfg, resolved, recipe, bank_samples), rank=info.rank, world_size=info.world_size,
                      device=info.device, ranks_on_node=info.local_world_size)


def raw_splits(cfg: TrainConfig) -> tuple[Dataset, Dataset]:
    """The run's train and val splits without transforms (CIFAR-10 on disk after :func:`preflight`)."""
    return load_raw_splits(cfg.dataset, cfg.data_dir, cfg.resolved_image_size(), cfg.synthetic_samples, cfg.debug)


def augmentation_preview(loaders: Loaders, is_main: bool, resume: Resume | None):
    """Rank 0 of a fresh run: the picture of the augmentation for TensorBoard, else None."""
    if not is_main or resume is not None:
        return None
    return augmentation_grid(loaders)
