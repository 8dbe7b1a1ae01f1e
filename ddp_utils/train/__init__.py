"""Training, by job, in the order a run meets them:

- ``train_config``: the settings both scripts share, the command line that fills them in, and
  the data plan they give ``data.pipeline.build_data``;
- ``session``: the life of one process (signals, process group, logging, exit codes, clean-up);
- ``preflight``: the checks every rank passes before anything is built, and what the "auto"
  data flags resolve to; ``check``: the same checks as ``--check``, printing the run;
- ``network``: the network on its device (DDP, compile, the GPU fast path); ``optimization``:
  the optimizer and its parameter groups, the scaler, the LR of every step; ``ema``: the
  classifier's moving average of the weights;
- ``resume`` (which checkpoint, does it fit, where the run starts), ``checkpoint`` (the file),
  ``run_folder`` (``--out`` and its records), ``pretrained`` (backbones for the classifier);
- ``run``: the record of one run and where it stands; ``accumulation``: the pieces of one
  optimizer step the scripts write out (windows, ``no_sync``, unscale and clip, LR);
  ``step_policy``: what follows a step (checkpoints, a NaN/Inf loss, a stop signal);
  ``unreadable_files``: all a run does about image files that cannot be decoded;
  ``monitor``: TensorBoard, progress lines, the step meter.
"""
