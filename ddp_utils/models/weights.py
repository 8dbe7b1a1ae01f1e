"""Published weights by name (``--weights``): torchvision's (``ResNet50_Weights.IMAGENET1K_V2``),
read from torch's hub cache and never downloaded by a run, so that a job behaves the same on a
node without a network; and how they are put into a network this project built."""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from ..config import UsageError

# the auxiliary classifiers torchvision's weights hold and this project's GoogLeNet and Inception v3 leave out
AUX_HEADS = ("AuxLogits.", "aux1.", "aux2.")


def torchvision_weights(name: str):
    """torchvision's weights called ``name`` (an enum's ``Class.MEMBER``), or None for a name that
    is not one (a path)."""
    import torchvision

    if "." not in name or os.sep in name or Path(name).exists():
        return None
    try:
        return torchvision.models.get_weight(name)
    except (ValueError, KeyError, AttributeError):
        return None


def cached_file(weights) -> Path:
    """Where torch's hub cache keeps ``weights``' file ($TORCH_HOME/hub/checkpoints/NAME)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)


def read_published(name: str, weights) -> dict[str, torch.Tensor]:
    """The tensors of ``weights`` from the hub cache, read as tensors only (``weights_only``); a
    file that is not there is bad input naming it and how to put it there."""
    path = cached_file(weights)
    if not path.is_file():
        raise UsageError(f"--weights {name}: {path.name} is not in torch's hub cache ({path.parent}); put it there "
                         f"from a machine with a network (python -c \"import torchvision; torchvision.models."
                         f"get_weight('{name}').get_state_dict()\" downloads it into that machine's cache), or "
                         f"point TORCH_HOME at a cache that holds it")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: what torch.load says, in one line
        raise UsageError(f"--weights {name}: {path} does not read as weights ({str(err).splitlines()[0]}); "
                         f"download it again") from None


def evaluation_view(weights) -> tuple[int, int, str]:
    """(crop px, resize px, interpolation) of ``weights``' own evaluation transforms."""
    view = weights.transforms()
    return view.crop_size[0], view.resize_size[0], view.interpolation.value


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
