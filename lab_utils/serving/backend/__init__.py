"""The python-backend model file copied into Triton model repositories (it runs inside Triton's stub)."""
