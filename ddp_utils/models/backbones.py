"""Backbones, and the linear probe around a trained one. The classifier takes the small networks
here and every classification model torchvision lists, by name; MoCo and the linear probe
(:class:`LinearProbe`, MoCo's linear-classification protocol) take the models that end in a
linear layer named ``fc`` (:func:`ends_in_fc`), which they swap for a projection head or a new
classifier."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

SMALL_NETS = ("lenet", "small_cnn")
RESNET_FAMILY = ("resnet", "resnext", "wide_resnet")  # torchvision's ResNet class: conv1, maxpool, fc
# Built without their auxiliary classifiers, whose second output a training step has no loss for.
WITHOUT_AUX_LOGITS = ("googlenet", "inception_v3")

# ResNets get the CIFAR stem (3x3 stride-1 conv, no max-pool) at or below this input size: the
# ImageNet stem would shrink a 32 px image to 8 px before the first residual block.
CIFAR_STEM_MAX_SIZE = 64
# Smallest input side (px): LeNet's two 5x5 convolutions and pools need 16; below these sizes the
# last stage of the others would see less than 2x2 pixels (small_cnn halves twice, a CIFAR-stem
# ResNet three times; above 64 px the ImageNet stem is used, far above its limit).
MIN_IMAGE_SIZE = {"lenet": 16, "small_cnn": 8}
RESNET_MIN_IMAGE_SIZE = 16
# The backbones whose classifier is one linear layer named fc, for a line that names them.
FC_BACKBONES = "lenet, small_cnn or a torchvision ResNet (resnet18 to resnet152, resnext*, wide_resnet*)"


def model_names() -> list[str]:
    """Every name the classifier's --arch takes: the small networks, then torchvision's
    classification models (``list_models``; imported here: importing torchvision costs about 2 s)."""
    import torchvision

    return [*SMALL_NETS, *torchvision.models.list_models(module=torchvision.models)]


def has_cifar_stem(arch: str) -> bool:
    """Whether ``arch`` gets the CIFAR stem at or below ``CIFAR_STEM_MAX_SIZE`` (the ResNet family)."""
    return arch.startswith(RESNET_FAMILY)


def ends_in_fc(arch: str) -> bool:
    """Whether ``arch`` is a model whose classifier is one linear layer named ``fc`` (what MoCo and
    the linear probe replace): the small networks and torchvision's ResNet family."""
    return arch in SMALL_NETS or has_cifar_stem(arch) and arch in model_names()


def min_image_size(arch: str) -> int | None:
    """The smallest input side (px) ``arch`` trains at, where this module knows it (None: the
    model's own first forward says)."""
    return MIN_IMAGE_SIZE.get(arch, RESNET_MIN_IMAGE_SIZE if has_cifar_stem(arch) else None)


class LeNet(nn.Module):
    """The CNN of PyTorch's CIFAR-10 tutorial (no BatchNorm, no dropout)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(5),  # identity at 32 px; lets other sizes through
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
        )
        self.fc = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def _conv_bn_relu(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU blocks and global pooling: trains in seconds on a CPU."""

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn_relu(3, width, 1),
            _conv_bn_relu(width, 2 * width, 2),
            _conv_bn_relu(2 * width, 4 * width, 2),
            _conv_bn_relu(4 * width, 4 * width, 1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def build_model(arch: str, num_classes: int, image_size: int) -> nn.Module:
    if arch == "lenet":
        return LeNet(num_classes)
    if arch == "small_cnn":
        return SmallCNN(num_classes)
    if arch not in model_names():
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(model_names())}")
    import torchvision

    extra = {"image_size": image_size} if arch.startswith("vit_") else {}  # its position embedding fits the image
    extra.update({"aux_logits": False, "init_weights": True} if arch in WITHOUT_AUX_LOGITS else {})
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **extra)
    if has_cifar_stem(arch) and image_size <= CIFAR_STEM_MAX_SIZE:
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def _shapes_only(arch: str, num_classes: int, image_size: int) -> nn.Module | None:
    """``arch`` with its parameters on the meta device (shapes, no memory, no arithmetic); None
    where its construction computes with tensors (RegNet's widths)."""
    try:
        with torch.device("meta"):
            return build_model(arch, num_classes, image_size)
    except NotImplementedError:
        return None


def parameter_count(arch: str, num_classes: int, image_size: int) -> int:
    """The parameters of ``arch`` built for ``num_classes``: counted on the meta device, or on a
    CPU build where the meta device cannot build it."""
    model = _shapes_only(arch, num_classes, image_size) or build_model(arch, num_classes, image_size)
    return sum(p.numel() for p in model.parameters())


def input_refusal(arch: str, image_size: int, sizes: Iterable[int]) -> tuple[int, str] | None:
    """The first of ``sizes`` (px, square) that ``arch``, built for ``image_size``, cannot take in
    a training forward, with the model's own reason (a kernel larger than what is left of the
    image, a ViT's fixed size, a patch that does not divide it); None when it takes them all or
    the meta device cannot run it (then its first forward says). No memory, no arithmetic."""
    def reason(err: Exception) -> str:
        return (str(err).strip().splitlines() or [type(err).__name__])[0]

    try:
        model = _shapes_only(arch, 10, image_size)
    except (RuntimeError, ValueError, AssertionError) as err:  # a ViT whose patch does not divide the image
        return image_size, reason(err)
    if model is None:
        return None
    model.train()
    for size in sizes:
        try:
            model(torch.empty(2, 3, size, size, device="meta"))
        except NotImplementedError:  # an op without a meta kernel: not the model's refusal
            return None
        except (RuntimeError, ValueError, AssertionError) as err:
            return size, reason(err)
    return None


def feature_dim(model: nn.Module) -> int:
    """Width of the features that enter ``model.fc``."""
    return model.fc.in_features


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
