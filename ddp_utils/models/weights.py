"""Published weights by name (``--weights``): torchvision's (``ResNet50_Weights.IMAGENET1K_V2``,
from torch's hub cache) and timm's (``timm/ARCH.TAG``, from the Hugging Face cache), never
downloaded by a run, so that a job behaves the same on a node without a network; and how they
are put into a network this project built."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from ..config import UsageError
from .backbones import TIMM_PREFIX, timm_for

# the auxiliary classifiers torchvision's weights hold and this project's GoogLeNet and Inception v3 leave out
AUX_HEADS = ("AuxLogits.", "aux1.", "aux2.")


@dataclass(frozen=True)
class PublishedWeights:
    """Weights published by name: torchvision's (``ResNet50_Weights.IMAGENET1K_V2``, from torch's hub
    cache) or timm's (``timm/ARCH.TAG``, from the Hugging Face cache)."""

    name: str                     # as --weights gave it
    models: tuple[str, ...]       # the --model names they are for
    file: Path                    # where the cache keeps them (it may not hold them)
    view: tuple[int, int, str]    # their evaluation view: crop px, resize px, interpolation
    fetch: str                    # the command that downloads them into a cache, on a machine with a network
    normalization: tuple[tuple[float, ...], tuple[float, ...]]  # the mean and std they were trained with

    def read(self) -> dict[str, torch.Tensor]:
        """Their tensors, read as tensors only (``weights_only``; timm's are safetensors); a file
        that is not in the cache is bad input naming it and how to put it there."""
        if not self.file.is_file():
            cache, home = (("the Hugging Face hub cache", "HF_HOME") if self.name.startswith(TIMM_PREFIX) else
                           ("torch's hub cache", "TORCH_HOME"))
            raise UsageError(f"--weights {self.name}: {self.file.name} is not in {cache} ({self.file.parent}); put it "
                             f"there from a machine with a network ({self.fetch} downloads it into that machine's "
                             f"cache), or point {home} at a cache that holds it")
        try:
            if self.file.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(self.file)
            return torch.load(self.file, map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated or foreign file: what the reader says, in one line
            raise UsageError(f"--weights {self.name}: {self.file} does not read as weights "
                             f"({str(err).splitlines()[0]}); download it again") from None


def published_weights(name: str) -> PublishedWeights | None:
    """The weights ``name`` names (torchvision's ``Class.MEMBER``, timm's ``timm/ARCH.TAG``), or None
    for a name that is neither (a checkpoint's path)."""
    if name.startswith(TIMM_PREFIX) and "." in name:
        return _timm_weights(name)
    if "." not in name or os.sep in name or Path(name).exists():
        return None
    import torchvision

    try:
        weights = torchvision.models.get_weight(name)
    except (ValueError, KeyError, AttributeError):
        return None
    view = weights.transforms()
    models = tuple(model for model in torchvision.models.list_models(module=torchvision.models)
                   if torchvision.models.get_model_weights(model) is type(weights))
    return PublishedWeights(name, models,
                            Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path),
                            (view.crop_size[0], view.resize_size[0], view.interpolation.value),
                            f"python -c \"import torchvision; torchvision.models.get_weight('{name}').get_state_dict()\"",
                            (tuple(view.mean), tuple(view.std)))


def _timm_weights(name: str) -> PublishedWeights | None:
    """timm's pretrained weights ``timm/ARCH.TAG``: their file in the Hugging Face hub cache
    (model.safetensors of their hub repository, as its refs/main names the snapshot) and timm's
    evaluation view of them (the crop, resized by crop_pct)."""
    from huggingface_hub import constants

    timm = timm_for(name)
    try:
        cfg = timm.models.get_pretrained_cfg(name[len(TIMM_PREFIX):])
    except RuntimeError:  # an unknown tag
        return None
    if cfg is None or not cfg.hf_hub_id:
        return None
    crop = cfg.input_size[-1]
    repo = Path(constants.HF_HUB_CACHE) / f"models--{cfg.hf_hub_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    snapshot = ref.read_text().strip() if ref.is_file() else "main"
    return PublishedWeights(name, (f"{TIMM_PREFIX}{cfg.architecture}",),
                            repo / "snapshots" / snapshot / "model.safetensors",
                            (crop, math.floor(crop / cfg.crop_pct), cfg.interpolation),
                            f"python -c \"import timm; timm.create_model('{name[len(TIMM_PREFIX):]}', pretrained=True)\"",
                            (tuple(cfg.mean), tuple(cfg.std)))


def put_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str, exact: bool,
                published: bool) -> list[str]:
    """Copy ``state`` into ``model``. The auxiliary classifiers the model leaves out (AUX_HEADS)
    are dropped; with ``published`` (torchvision's weights) a model with ``transform_input``
    (GoogLeNet, Inception v3) takes the input rescaling its torchvision builder sets for them,
    the one they were trained with. ``exact``: every other tensor must fit
    (an evaluation); else the tensors whose shape differs (a classifier for other classes) keep
    the model's fresh ones, returned by name (fine-tuning). Anything else that does not fit is
    bad input naming ``source``."""
    own = model.state_dict()
    state = {k: v for k, v in state.items() if k in own or not k.startswith(AUX_HEADS)}
    fresh = [k for k, v in state.items() if k in own and v.shape != own[k].shape]
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected or (fresh and exact):
        if missing or unexpected:
            detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
            raise UsageError(f"--weights {source}: its tensors do not fit this --model ({detail}); give the weights "
                             f"of this model, or the model of these weights")
        raise UsageError(f"--weights {source}: {fresh[0]} is {tuple(state[fresh[0]].shape)} there and "
                         f"{tuple(own[fresh[0]].shape)} here: weights for other classes than this data's; evaluate "
                         f"them on the data they classify")
    model.load_state_dict({k: v for k, v in state.items() if k not in fresh}, strict=False)
    if published and hasattr(model, "transform_input"):
        model.transform_input = True
    return fresh
