"""Helpers for the NVIDIA AI stack lab course. Importing this package starts no work."""

__version__ = "0.1.0"

import os
from pathlib import Path

# Package data: raw captures from the reference machines, lab 05's rules and dashboard, the version manifest.
DATA_DIR = Path(__file__).parent / "data"

# The course forks its servers (fork, then exec) from processes whose other threads make gRPC calls (a kernel's
# tritonclient, a test's load). gRPC's fork support then let a child abort (SIGABRT) or crash before its exec, and
# closed the parent's own streams: 8 of 477 children died, one stream was cut, in 30 s of starts beside four gRPC
# callers; 0 of 1,064 with it off. Read when grpc is imported: this must come first. Nothing in the course uses
# gRPC in a forked child (load clients are spawned, ranks come from a forkserver).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
