"""A picture of what the training augmentation does: a few training images, each followed by its
augmented view(s) (MoCo: query and key), as they enter the network but un-normalised. Rank 0
writes it to TensorBoard's images tab at the start of a run."""
from __future__ import annotations

import torch

from .image_files import ImageFiles
from .pipeline import Loaders
from .recipes import eval_recipe
from .sets import in_memory_tensors

COLUMNS = {1: ("image", "augmented"), 2: ("image", "query", "key")}  # by the number of views
MIN_TILE = 64  # px on screen: small images are enlarged (nearest neighbour, pixels kept sharp)
PADDING, HEADER = 2, 14  # px


@torch.no_grad()
def augmentation_grid(loaders: Loaders, count: int = 8) -> torch.Tensor:
    """3 x H x W in [0, 1]: a header naming the columns, then one row per sample (the first
    ``count``, ``ImageFiles.first_samples``; epoch 0): the image, then its view(s) (``Loaders.training_views``); tiles of at
    least MIN_TILE px."""
    plan = loaders.plan
    dataset, size, normalization = plan.dataset, plan.train_image_size, plan.normalization
    train = loaders.train_set
    index = list(train.first_samples(count) if isinstance(train, ImageFiles) else range(min(count, len(train))))
    views = loaders.training_views(index)
    originals = _originals(loaders.train_set, index, size)
    rows = [torch.stack([originals[i], *(_unnormalize(v[i].float().cpu(), dataset, normalization) for v in views)])
            for i in range(len(index))]
    scale = -(-MIN_TILE // size)  # ceil
    tiles = torch.nn.functional.interpolate(torch.cat(rows), scale_factor=scale, mode="nearest") if scale > 1 \
        else torch.cat(rows)
    grid = _tile(tiles, columns=1 + len(views))
    return torch.cat([_header(COLUMNS[len(views)], grid.shape[2], size * scale), grid], dim=1)


def _tile(tiles: torch.Tensor, columns: int) -> torch.Tensor:
    """3 x H x W: ``tiles`` (N x 3 x h x w) row by row, ``columns`` per row, each framed by
    PADDING white pixels (as torchvision's make_grid with pad_value 1)."""
    n, channels, h, w = tiles.shape
    rows = -(-n // columns)
    grid = tiles.new_ones((channels, rows * (h + PADDING) + PADDING, columns * (w + PADDING) + PADDING))
    for i, tile in enumerate(tiles):
        top, left = PADDING + (i // columns) * (h + PADDING), PADDING + (i % columns) * (w + PADDING)
        grid[:, top:top + h, left:left + w] = tile
    return grid


def _header(labels: tuple[str, ...], width: int, tile: int) -> torch.Tensor:
    """3 x HEADER x width: each label centred over its column, black on white."""
    from PIL import Image, ImageDraw

    strip = Image.new("RGB", (width, HEADER), "white")
    draw = ImageDraw.Draw(strip)
    for column, label in enumerate(labels):
        centre = PADDING + column * (tile + PADDING) + tile / 2
        draw.text((centre - draw.textlength(label) / 2, 1), label, fill="black")
    return torch.frombuffer(bytearray(strip.tobytes()), dtype=torch.uint8).view(HEADER, width, 3).permute(2, 0, 1) / 255


def _originals(raw, index: list[int], size: int) -> list[torch.Tensor]:
    """The un-augmented images at the network's input size, 3 channels in [0, 1]."""
    tensors = in_memory_tensors(torch.utils.data.Subset(raw, index))
    if tensors is not None:
        images = tensors[0].float() / (255.0 if tensors[0].dtype == torch.uint8 else 1.0)
    else:  # decoded from files
        from torchvision.transforms import v2 as T

        to_tensor = T.Compose([T.ToImage(), T.Resize(size, antialias=True), T.CenterCrop(size),
                               T.ToDtype(torch.float32, scale=True)])
        images = torch.stack([to_tensor(raw[i][0]) for i in index])
    images = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear", antialias=True)
    return list(images.expand(-1, 3, -1, -1).clamp(0, 1))


def _unnormalize(view: torch.Tensor, dataset: str, normalization: str) -> torch.Tensor:
    recipe = eval_recipe(dataset, normalization)
    if recipe.mean is None:  # synthetic noise: stretch to [0, 1]
        return (view - view.min()) / (view.max() - view.min()).clamp_min(1e-6)
    mean, std = (torch.tensor(s).view(-1, 1, 1) for s in (recipe.mean, recipe.std))
    return (view * std + mean).clamp(0, 1)
