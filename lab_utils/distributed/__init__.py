"""Lab 02: ranks in process groups, collectives and their bandwidth, NCCL's own log, DDP training.

``spawn`` launches ranks from a notebook and holds each rank's start and end in a group (``scripts/train_ddp.py``
uses the same two ends under torchrun; ``launch(group=False)`` lets a rank's function join its group itself, as
a torchrun script does); ``ranks`` sends a function written in a notebook cell to the ranks as source (by-hand
cells and the code exercises); ``bandwidth`` the nccl-tests arithmetic and the link's peak; ``collectives`` the
checked, timed sweeps; ``nccl_log`` reads ``NCCL_DEBUG=INFO`` logs; ``ddp`` DDP training; ``bandwidth_plots`` the
busbw plot; ``plan`` the lab's ranks, backend, sizes and counts for the GPUs found, chosen in one place.
``bandwidth``, ``nccl_log``, ``bandwidth_plots`` and ``plan`` need no torch."""
