"""Training, by job, in the order a run meets them:

- ``train_config``: the settings both scripts share, the command line that fills them in, the
  data plan they give ``data.pipeline.build_data``, and ``ResolvedSettings``: what the "auto"
  data flags came to;
- ``session``: the life of one process (signals, process group, logging, exit codes, clean-up)
  and how the network runs on its device (DDP, compile, the GPU fast path);
- ``preflight``: the checks every rank passes before anything is built, and what the "auto"
  data flags resolve to; ``check``: the same checks as ``--check``, printing the run;
- ``optimization``: the optimizer and its parameter groups, the scaler, the LR of every step;
  ``ema``: the classifier's moving average of the weights;
- ``resume`` (which checkpoint, does it fit, where the run starts), ``checkpoint`` (the file,
  and a run's checkpoint saved), ``run_folder`` (``--out`` and its records), ``pretrained``
  (backbones for the classifier);
- ``run``: the record of one run (what it is made of) and its start; ``run_state``: where it
  stands; ``batches``: its training batches in accumulation windows, the clock of the loop's
  wait for them, and the window's undo (what a window given up puts back, registered
  explicitly); ``accumulation``: the pieces of one optimizer step the scripts write out
  (windows, ``no_sync``, the fp16 overflow, LR);
  ``step_policy``: what follows a step (the run's end, a NaN/Inf loss, a stop signal);
  ``unreadable_files``: all a run does about image files that cannot be decoded;
  ``monitor``: TensorBoard, progress lines, the step meter (which logs the share of time the
  loop waited), the input-bound advice.
"""
