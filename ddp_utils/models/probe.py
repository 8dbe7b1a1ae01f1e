"""MoCo's linear-classification protocol: a frozen backbone under a new linear classifier."""
from __future__ import annotations

import torch
from torch import nn


class LinearProbe(nn.Module):
    """``model``'s backbone, frozen and always in eval mode (its BatchNorm statistics never move),
    under a new linear ``fc``; ``feature_norm`` puts a parameter-free BatchNorm on the features
    first (MAE's probe), so that ordinary LRs work whatever their scale."""

    def __init__(self, model: nn.Module, num_classes: int, feature_norm: bool = False):
        super().__init__()
        width = model.fc.in_features
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
        with torch.no_grad():  # no graph through the frozen part: less memory, no stray gradients
            features = self.backbone(x)
        return self.fc(self.feature_norm(features))

    def backbone_snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.backbone.state_dict().items()}
