"""Training: the shared config and command line, the session around a run, build helpers, the run
record, accumulation and the optimizer step, what happens between steps, schedule, precision,
checkpoints, resume and run folders, monitoring, pretrained weights."""
