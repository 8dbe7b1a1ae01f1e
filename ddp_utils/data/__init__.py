"""Data: what one batch is, file by file, in the order a batch passes them.

1. ``recipes``: the augmentation as data, an :class:`AugmentRecipe` per view (the classifier's,
   MoCo's v1/v2, and ``eval_recipe``, the evaluation view and the one lookup of the
   normalisation statistics).
2. ``pipeline``: ``build_data(plan) -> Loaders``, the one way from a run's data plan to its
   batches. It loads the raw splits, chooses the path (below), and makes the training batches,
   validation and MoCo's kNN bank with one function, on each rank's share (``order``: the
   samples order, or for shards the one in which each rank reads whole shards, each resumable
   with its own state; sharded evaluation), per-sample seeding, the DataLoader (written once)
   and its batches (``LoaderBatches``), the in-memory path's batches on the device
   (``DeviceBatches``).
3. ``sets``: the raw splits (digits, CIFAR-10, synthetic noise, ImageFolder), the ``--debug``
   and kNN-bank subsets, in-memory splits as tensors.
4. ``image_files``: image files as samples, listed, read and decoded on the CPU: ImageFolder's
   files as data sets (their ``FolderListing``, made once per job by rank 0 in
   ``train.preflight`` and sent to every rank), each file read as PIL, decoded pixels
   (torchvision's JPEG decoder, PIL) or encoded bytes (the JPEG marker test says what the
   device's decoder is given); ``unreadable``: files that cannot be decoded (the rank's registry
   of them, whose ``record`` every pass of image files calls on each batch it hands out, their
   reasons, ``--check-data``'s pass). ``ShardFiles`` reads
   the same files from an image folder's shards (``shards``: the layout ``write_shards.py``
   writes, its index, any sample by number), on a file system or in an S3 bucket
   (``object_store``: the requests and their faults; ``shard_cache``: the node's bounded cache of
   whole shards, filled ahead of the reads by each rank's read-ahead).
5. Then, on one of three paths:

   * in-memory data augmented on the device: ``pipeline.DeviceBatches`` gathers each batch from
     the split held there and hands it to ``batch_augment``;
   * image files augmented on the device: ``files_on_device`` (opt-in, chosen by ``pipeline``):
     workers pack each batch (or its files' bytes) into shared memory; in the training process a
     thread of its own decodes there if asked and hands the packed batch to ``batch_augment``,
     ahead of the training loop;
   * the loader path, the reference: ``transforms``, torchvision's per-sample views in the
     workers.

6. ``batch_augment``: every view of a batch at once on the device (crop, colour, blur, flip,
   normalisation), keyed by (seed, epoch, index) through ``ddp_utils.hashing``.
   ``data_stream``: the hand-over to the training loop, ``Batches``, the one protocol of every
   path's passes (iterate, prepare the next, close; ``LoopBatches`` on the loop's thread, the
   next device batch made early when asked; ``files_on_device.ThreadBatches`` by a thread of its
   own); on CUDA both device paths make their batches on a stream of their own and hand them to
   the training stream (who waits for whom).

Beside the batches: ``host_memory`` bounds the shared and pinned memory the workers fill (checked
before a run starts); ``preview`` draws the augmentation for TensorBoard.
"""
