"""Training: the config both scripts share, gradient accumulation, LR schedule, precision,
checkpoints and run folders, resume, monitoring, pretrained weights, and the run skeleton."""
