"""Distributed plumbing shared by train_classifier.py and train_moco.py."""
from .runtime.dist import (
                   DistInfo,
                   cleanup_distributed,
                   detect_launch,
                   get_rank,
                   get_world_size,
                   init_distributed,
                   is_main_process,
)

__all__ = ["DistInfo", "cleanup_distributed", "detect_launch", "get_rank", "get_world_size",
           "init_distributed", "is_main_process"]
