"""Data: the data sets (``sets``), the augmentation recipes (``recipes``), per-sample transforms
run in DataLoader workers (``transforms``), batched augmentation on the training device
(``batch_augment``), and the samplers and loaders that turn them into each rank's batches (``loading``)."""
