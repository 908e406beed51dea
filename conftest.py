"""Test-wide settings: notebooks executed by nbval use the labs' quick sizes (NVLAB_QUICK)."""

import os

os.environ.setdefault("NVLAB_QUICK", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
