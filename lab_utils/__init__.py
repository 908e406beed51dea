"""Helpers for the NVIDIA AI stack lab course. Importing this package starts no work."""

__version__ = "0.1.0"

from pathlib import Path

# Package data: raw captures from the reference machines, lab 05's rules and dashboard, the version manifest.
DATA_DIR = Path(__file__).parent / "data"
