"""One process in a job, in the order a run meets them:

- ``launch``: how this process was launched (torchrun, srun or plain python), read from its
  environment; the node's name and the job's restart count;
- ``device``: the device a rank takes and its backend (one-line errors where none can work), two
  ranks on one GPU, the memory format of a batch and of the model on the device (``to_device``,
  ``place_model``);
- ``dist``: the process group (``init_distributed``, ``cleanup_distributed``), the rank helpers
  that also work without one, DDP and ``torch.compile`` around the network (``wrap_network``),
  ``unwrap``;
- ``precision``: the forward's autocast and fp16's loss scaler, from ``--amp``;
- ``collectives``: collectives that also work as one process; ``stopping``: stop signals, the
  ranks' per-step agreement and exit codes; ``logs``: rank-0 logging; ``faults``: fault injection
  for the tests; ``spawn``: local processes started as torchrun starts them (tests, benchmarks).
"""
