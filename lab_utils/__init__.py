"""Helpers for the NVIDIA AI stack lab course. Importing this package starts no work."""

__version__ = "0.1.0"
