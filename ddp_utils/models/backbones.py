"""Backbones, and the linear probe around a trained one. The classifier takes the small networks
here and every classification model torchvision lists, by name, and timm's as ``timm/NAME`` where
timm is installed (requirements-timm.txt). MoCo replaces a model's linear classifier, whatever its
name (:func:`without_head`), with its projection head; the linear probe (:class:`LinearProbe`,
MoCo's linear-classification protocol) takes the models that end in a linear layer named ``fc``
(:func:`ends_in_fc`)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..config import UsageError

SMALL_NETS = ("lenet", "small_cnn")
RESNET_FAMILY = ("resnet", "resnext", "wide_resnet")  # torchvision's ResNet class: conv1, maxpool, fc
# Built without their auxiliary classifiers, whose second output a training step has no loss for.
WITHOUT_AUX_LOGITS = ("googlenet", "inception_v3")

# ResNets get the CIFAR stem (3x3 stride-1 conv, no max-pool) at or below this input size: the
# ImageNet stem would shrink a 32 px image to 8 px before the first residual block.
CIFAR_STEM_MAX_SIZE = 64
# Smallest input side (px): LeNet's 5x5 convolutions and pools need 16; below the others' the last
# stage sees under 2x2 pixels (small_cnn halves twice, a CIFAR-stem ResNet three times).
MIN_IMAGE_SIZE = {"lenet": 16, "small_cnn": 8}
RESNET_MIN_IMAGE_SIZE = 16
# The backbones whose classifier is one linear layer named fc, for a line that names them.
FC_BACKBONES = "lenet, small_cnn or a torchvision ResNet (resnet18 to resnet152, resnext*, wide_resnet*)"
# What MoCo takes, for a line that names them.
HEADED_BACKBONES = ("lenet, small_cnn, or a torchvision or timm classifier whose logits come from a linear layer "
                    "(all but SqueezeNet)")
# timm's models: --arch timm/NAME, NAME one of timm.list_models(); timm is an optional requirement.
TIMM_PREFIX = "timm/"
TIMM_REQUIREMENT = "requirements-timm.txt"


def model_names() -> list[str]:
    """Every name the classifier's --arch takes: the small networks, then torchvision's
    classification models (``list_models``; imported here: importing torchvision costs about 2 s)."""
    import torchvision

    return [*SMALL_NETS, *torchvision.models.list_models(module=torchvision.models)]


def is_timm(arch: str) -> bool:
    """Whether ``arch`` names one of timm's models (``timm/NAME``)."""
    return arch.startswith(TIMM_PREFIX)


def timm_for(arch: str):
    """The timm module, imported for ``arch`` (``timm/NAME``; about 1.5 s, so only for such a name):
    a UsageError of one line naming the requirement where timm is not installed."""
    try:
        import timm
    except ImportError:
        raise UsageError(f"--arch {arch} needs timm: pip install -r {TIMM_REQUIREMENT}") from None
    return timm


def timm_model_names(arch: str) -> list[str]:
    """timm's model names (without the ``timm/`` prefix), imported for ``arch`` (see :func:`timm_for`)."""
    return timm_for(arch).list_models()


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
    if is_timm(arch):
        return _build_timm(arch, num_classes, image_size)
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


def _build_timm(arch: str, num_classes: int, image_size: int) -> nn.Module:
    """timm's ``create_model(NAME, pretrained=False, num_classes=...)``; the models that take an
    ``img_size`` (ViTs, Swin, MaxViT, CoAtNet...) are built for ``image_size``, as torchvision's
    ViTs are; the others (whose constructor refuses the keyword) without it."""
    timm, name = timm_for(arch), arch[len(TIMM_PREFIX):]
    if name not in timm.list_models():
        raise ValueError(f"unknown arch {arch!r}: not one of timm.list_models()")
    try:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, img_size=image_size)
    except TypeError as err:
        if "img_size" not in str(err):
            raise
    return timm.create_model(name, pretrained=False, num_classes=num_classes)


def shapes_only(arch: str, num_classes: int, image_size: int) -> nn.Module | None:
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
    model = shapes_only(arch, num_classes, image_size) or build_model(arch, num_classes, image_size)
    return sum(p.numel() for p in model.parameters())


# What a model raises for an input size it cannot take (timm's window partitions: a zero-sized
# window at a small size, ZeroDivisionError).
SIZE_REFUSALS = (RuntimeError, ValueError, AssertionError, ZeroDivisionError)


def input_refusal(arch: str, image_size: int, sizes: Iterable[int]) -> tuple[int, str] | None:
    """The first of ``sizes`` (px, square) that ``arch``, built for ``image_size``, cannot take in
    a training forward, with the model's own reason (a kernel larger than what is left of the
    image, a ViT's fixed size, a patch that does not divide it); None when it takes them all or
    the meta device cannot run it (then its first forward says). No memory, no arithmetic."""
    def reason(err: Exception) -> str:
        return (str(err).strip().splitlines() or [type(err).__name__])[0]

    try:
        model = shapes_only(arch, 10, image_size)
    except SIZE_REFUSALS as err:  # a ViT whose patch does not divide the image
        return image_size, reason(err)
    if model is None:
        return None
    model.train()
    for size in sizes:
        try:
            model(torch.empty(2, 3, size, size, device="meta"))
        except NotImplementedError:  # an op without a meta kernel: not the model's refusal
            return None
        except SIZE_REFUSALS as err:
            return size, reason(err)
    return None


def activation_bytes(arch: str, num_classes: int, image_size: int, batch: int) -> int | None:
    """Bytes of the tensors a training forward of ``batch`` fp32 images keeps for the backward
    (each storage once, the parameters left out), counted on the meta device: no memory, no
    arithmetic; None where the meta device cannot build or run ``arch``. An estimate: attention
    keeps more on the meta device than a CPU's fused kernel (tests/test_model_zoo.py bounds the
    difference); autocast in bf16 or fp16 keeps about half."""
    model = shapes_only(arch, num_classes, image_size)
    if model is None:
        return None
    # a storage's identity: meta tensors have no data pointer to tell them apart
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters:
            kept[storage._cdata] = storage.nbytes()
        return tensor

    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model(torch.empty(batch, 3, image_size, image_size, device="meta"))
    except (NotImplementedError, *SIZE_REFUSALS):  # no meta kernel, or a size the model refuses (said elsewhere)
        return None
    return sum(kept.values())


def classifier_head(model: nn.Module, num_classes: int) -> str | None:
    """The dotted name of ``model``'s classifier: the last linear layer that gives ``num_classes``
    outputs (``fc`` in the ResNet family and the small networks, ``heads.head`` in ViT, ``head``
    in Swin, ``classifier.N`` in most others); None where the logits come from another layer
    (SqueezeNet's convolution)."""
    found = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module.out_features == num_classes]
    return found[-1] if found else None


def head_of(arch: str) -> str | None:
    """:func:`classifier_head` of ``arch``, built on the meta device where it can be."""
    return classifier_head(shapes_only(arch, 10, 224) or build_model(arch, 10, 224), 10)


def without_head(model: nn.Module, num_classes: int) -> tuple[str, int]:
    """Replace ``model``'s classifier (:func:`classifier_head`) by the identity, so that the model
    gives the features it took: returns the head's name and their width."""
    name = classifier_head(model, num_classes)
    if name is None:
        raise ValueError("the model's logits come from no linear layer")
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent)
    width = owner.get_submodule(leaf).in_features
    setattr(owner, leaf, nn.Identity())
    return name, width


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
