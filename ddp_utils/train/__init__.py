"""Training, by job, in the order a run meets them:

- ``train_config``: the settings both scripts share, the command line that fills them in, the
  data plan they give ``data.pipeline.build_data``, and ``ResolvedSettings``: what the "auto"
  data flags came to;
- ``session``: the life of one process (signals, process group, logging, exit codes, clean-up)
  and the ranks' one agreement per optimizer step;
- ``preflight``: the checks every rank passes before anything is built, and what the "auto"
  data flags resolve to; ``check``: the same checks as ``--check``, printing the run;
- ``optimization``: the optimizer and its parameter groups, the scaler, the LR of every step;
  ``ema``: the classifier's moving average of the weights;
- ``resume`` (which checkpoint, does it fit, where the run starts), ``checkpoint`` (the file),
  ``run_folder`` (``--out`` and its records), ``pretrained`` (backbones for the classifier);
- ``run``: one run: what it is made of, where it stands, its training batches in accumulation
  windows, the clock of the loop's wait for them and the window's undo (what a window given up puts back, registered explicitly), its
  start, what follows a step (the run's end, a NaN/Inf loss, a stop signal) and its checkpoint;
  ``accumulation``: the pieces of one optimizer step the scripts write out (windows,
  ``no_sync``, the fp16 overflow, LR);
  ``unreadable_files``: all a run does about image files that cannot be decoded;
  ``monitor``: TensorBoard, progress lines, the step meter (which logs the share of time the
  loop waited), the input-bound advice.
"""
