"""Moving a MoCo backbone into a classifier: export, load, and the frozen linear probe."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..config import UsageError
from .checkpoint import UnreadableCheckpoint, load_data

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


def load_pretrained_backbone(model: nn.Module, path: str | os.PathLike, arch: str) -> None:
    """Load every weight but ``fc`` into ``model``; anything else missing or extra is an error."""
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
                         f"({str(err).splitlines()[1].strip()})") from None
    if unexpected or set(missing) != {"fc.weight", "fc.bias"}:
        raise UsageError(f"--pretrained {path} does not match --arch: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")


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


class LinearProbe(nn.Module):
    """A frozen backbone (always in eval mode, so BatchNorm statistics do not move) under a new
    linear classifier, MoCo's linear-classification protocol."""

    def __init__(self, model: nn.Module, num_classes: int, feature_norm: bool = False):
        super().__init__()
        width = model.fc.in_features
        # Optional parameter-free BatchNorm on the features (MAE's linear probe does the same):
        # the probe then trains at ordinary LRs whatever the scale of the frozen features.
        self.feature_norm = nn.BatchNorm1d(width, affine=False) if feature_norm else nn.Identity()
        self.fc = nn.Linear(width, num_classes)
        nn.init.normal_(self.fc.weight, std=0.01)  # as in MoCo's main_lincls
        nn.init.zeros_(self.fc.bias)
        model.fc = nn.Identity()
        self.backbone = model.requires_grad_(False)

    def train(self, mode: bool = True) -> "LinearProbe":
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # no graph through the frozen part: less memory, no stray grads
            features = self.backbone(x)
        return self.fc(self.feature_norm(features))

    def backbone_snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.backbone.state_dict().items()}
