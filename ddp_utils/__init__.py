"""Distributed plumbing shared by train_classifier.py and train_moco.py, in layers; a module
imports only from its own layer or those above it in this list (``tests/test_layers.py``):

1. ``config`` (flags from dataclasses), ``hashing`` (counter-based randomness);
2. ``runtime``: one process in a job (launch, device, process group, precision, collectives,
   stop signals and exit codes, logging, fault injection);
3. ``data``: a run's batches;
4. ``models`` (backbones, MoCo, the linear probe), ``eval`` (the kNN monitor);
5. ``train``: a run's life, by job.

This file imports nothing: Python runs it before any module of the package, the bottom one too.
"""
