"""Lab 02: spawned ranks, NCCL/gloo collectives, NCCL's debug log, and DDP training."""
