"""Where a classifier's first weights come from: a MoCo backbone (``--pretrained``; its export as
a plain state dict, and loading it) or whole weights (``--weights``: torchvision's published ones
by name, or a checkpoint of this project)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..config import UsageError
from ..data.sets import NATIVE_SIZE
from ..models.weights import published_weights
from .checkpoint import (
    UnreadableCheckpoint,
    load_data,
    mismatch_detail,
    newest_checkpoint_in,
    read_checkpoint,
)

QUERY_BACKBONE = "encoder_q.backbone."


def backbone_state_dict(source: dict) -> dict[str, torch.Tensor]:
    """The query backbone from a train_moco.py checkpoint, or an exported backbone as is."""
    model_state = source.get("model", source)
    if any(k.startswith(QUERY_BACKBONE) for k in model_state):
        return {k[len(QUERY_BACKBONE):]: v for k, v in model_state.items() if k.startswith(QUERY_BACKBONE)}
    if any(k.startswith(("encoder_q.", "encoder_k.")) for k in model_state):
        raise UsageError("checkpoint has a MoCo model without a backbone/head split; re-export it")
    return {k: v for k, v in model_state.items() if not k.startswith("fc.")}


def read_pretrained(path: str | os.PathLike) -> dict:
    """A train_moco.py / train_classifier.py checkpoint, or an exported backbone (a plain state
    dict), read as data only."""
    try:
        source = load_data(path)
    except UnreadableCheckpoint as err:
        raise UsageError(f"--pretrained {path}: {err}") from None
    if not isinstance(source, dict):
        raise UsageError(f"--pretrained {path}: not a checkpoint or an exported backbone")
    return source


def pretrained_file(path: str | os.PathLike) -> Path:
    """``--pretrained``: a file as given; a run folder means its newest checkpoint."""
    return newest_checkpoint_in(path, "--pretrained") if Path(path).is_dir() else Path(path)


def pretrained_image_size(path: str | os.PathLike) -> int | None:
    """The image side the backbone was trained at (None for an exported backbone)."""
    return _trained_image_size(read_pretrained(path))


def _trained_image_size(source: dict) -> int | None:
    config = source.get("config")  # a checkpoint's; an exported backbone records none
    if not isinstance(config, dict) or "dataset" not in config:
        return None
    resolved = source.get("resolved")  # the side its run took, whatever decided it (its flags, its own --pretrained)
    return (isinstance(resolved, dict) and resolved.get("image_size")) or config.get("image_size") or \
        NATIVE_SIZE.get(config["dataset"])


def load_pretrained_backbone(model: nn.Module, path: str | os.PathLike, arch: str) -> int | None:
    """Load every weight but ``fc`` into ``model``; anything else missing or extra is an error.
    Returns the image side the backbone was trained at (None for an exported backbone)."""
    source = read_pretrained(path)
    config = source.get("config")
    trained_arch = config.get("arch") if isinstance(config, dict) else None  # exported backbones have none
    if trained_arch is not None and trained_arch != arch:
        raise UsageError(f"--pretrained {path}: a {trained_arch} backbone, but this run has --arch {arch}; "
                         f"pass --arch {trained_arch}")
    state = backbone_state_dict(source)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatch: another architecture or stem
        raise UsageError(f"--pretrained {path} does not fit this --arch/--image-size "
                         f"({mismatch_detail(err)})") from None
    if unexpected or set(missing) != {"fc.weight", "fc.bias"}:
        raise UsageError(f"--pretrained {path} does not match --arch: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
    return _trained_image_size(source)


def export_backbone(backbone: nn.Module, path: str | os.PathLike) -> Path:
    """Write the backbone as a plain state dict (torchvision names, no ``fc``), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({k: v.detach().cpu().clone() for k, v in backbone.state_dict().items()}, tmp)
    os.replace(tmp, path)
    return path


def tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def read_weights(name: str, arch: str) -> tuple[dict[str, torch.Tensor], bool]:
    """``--weights NAME``'s tensors and whether they are published ones, torchvision's or timm's
    (else a checkpoint of this project: a file, or a run folder's newest; its --arch must be
    ``arch``)."""
    weights = published_weights(name)
    if weights is not None:
        return weights.read(), True
    path = newest_checkpoint_in(name, "--weights") if Path(name).is_dir() else Path(name)
    try:
        source = read_checkpoint(path)
    except UnreadableCheckpoint as err:
        raise UsageError(f"--weights {name}: {err}") from None
    if source["script"] != "train_classifier.py":
        raise UsageError(f"--weights {name}: a {source['script']} checkpoint; its backbone starts a classifier "
                         f"with --pretrained")
    trained_arch = source["config"].get("arch")
    if trained_arch != arch:
        raise UsageError(f"--weights {name}: a {trained_arch} checkpoint, but this run has --model {arch}; pass "
                         f"--model {trained_arch}")
    return source["model"], False
