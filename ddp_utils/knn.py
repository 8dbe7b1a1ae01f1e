"""Weighted k-nearest-neighbour accuracy of frozen features: MoCo's training monitor.

The memory bank is the (un-augmented) training split's features; each validation image votes with
its k most similar bank entries, weighted by exp(cosine / T) (Wu et al. 2018, as in the MoCo
authors' CIFAR demo: k=200, T=0.1). Feature extraction is sharded across ranks and gathered.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from .collectives import all_gather_object, concat_all_gather, reduce_metrics


@torch.no_grad()
def extract_features(backbone: nn.Module, loader: DataLoader, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's unit-length features (n x D) and labels (n)."""
    feats, labels = [], []
    for images, targets in loader:
        feats.append(F.normalize(backbone(images.to(device)).float(), dim=1))
        labels.append(targets.to(device))
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def gather_uneven(x: torch.Tensor) -> torch.Tensor:
    """Concatenate tensors whose first dimension differs between ranks (padded all_gather)."""
    sizes = all_gather_object(x.shape[0])
    padded = torch.zeros((max(sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    gathered = concat_all_gather(padded).view(len(sizes), max(sizes), *x.shape[1:])
    return torch.cat([gathered[r, :n] for r, n in enumerate(sizes)])


@torch.no_grad()
def knn_predict(features: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor,
                num_classes: int, k: int, T: float, chunk: int = 256) -> torch.Tensor:
    """Predicted labels for ``features`` (n x D) from the bank (M x D), in chunks to bound memory."""
    k = min(k, bank.shape[0])
    preds = []
    for start in range(0, features.shape[0], chunk):
        sim = features[start:start + chunk] @ bank.T                      # c x M
        top_sim, top_idx = sim.topk(k, dim=1)                               # c x k
        weights = (top_sim / T).exp()
        votes = torch.zeros(sim.shape[0], num_classes, device=sim.device)
        votes.scatter_add_(1, bank_labels[top_idx], weights)                # c x classes
        preds.append(votes.argmax(dim=1))
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=features.device)


@torch.no_grad()
def knn_accuracy(backbone: nn.Module, bank_loader: DataLoader, val_loader: DataLoader,
                 num_classes: int, device: torch.device, k: int = 200, T: float = 0.1) -> float:
    """Top-1 kNN accuracy (%) over the whole validation split, each sample counted once."""
    was_training = backbone.training
    backbone.eval()
    bank, bank_labels = extract_features(backbone, bank_loader, device)
    bank, bank_labels = gather_uneven(bank), gather_uneven(bank_labels)  # the full train split
    val, val_labels = extract_features(backbone, val_loader, device)     # this rank's shard
    backbone.train(was_training)
    correct = (knn_predict(val, bank, bank_labels, num_classes, k, T) == val_labels).sum().item()
    total = reduce_metrics({"correct": correct, "count": len(val_labels)}, device)
    return 100.0 * total["correct"] / total["count"]
