"""The oracle for the sharded kNN monitor (ddp_utils/eval/knn.py): the straightforward search
over the whole bank, gathered on every rank in fp32, as the monitor was first written. Used by
tests/test_knn.py and bench/knn.py; never by training."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_utils.eval.knn import extract_features
from ddp_utils.runtime.collectives import all_gather_object, concat_all_gather, reduce_metrics


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
        weights = ((top_sim - top_sim[:, :1]) / T).exp()                    # no overflow for small T
        votes = torch.zeros(sim.shape[0], num_classes, device=sim.device)
        votes.scatter_add_(1, bank_labels[top_idx], weights)                # c x classes
        preds.append(votes.argmax(dim=1))
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=features.device)


@torch.no_grad()
def knn_accuracy_gathered(backbone: nn.Module, bank_loader: DataLoader, val_loader: DataLoader,
                          num_classes: int, device: torch.device, k: int = 200, T: float = 0.1) -> float:
    """The reference for ``knn_accuracy``: the whole train split's features (fp32) gathered on
    every rank (M x D each: ~10 GB at ImageNet size)."""
    was_training = backbone.training
    backbone.eval()
    bank, bank_labels = extract_features(backbone, bank_loader, device)
    bank, bank_labels = gather_uneven(bank), gather_uneven(bank_labels)  # the full train split
    val, val_labels = extract_features(backbone, val_loader, device)     # this rank's shard
    backbone.train(was_training)
    correct = (knn_predict(val, bank, bank_labels, num_classes, k, T) == val_labels).sum().item()
    total = reduce_metrics({"correct": correct, "count": len(val_labels)}, device)
    return 100.0 * total["correct"] / total["count"]
