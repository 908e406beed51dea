"""Code that exists only because of the environment the course runs in; each module says when it can go.

The first line of each module's docstring says what it works around and when it goes; the rest of ``lab_utils``
uses the stack as it is meant to be used, and calls these where the environment needs them. Nothing here imports
above ``lab_utils.course``.

- ``numpy1_env``: the NumPy-1 execution environment for the pytriton wheel's python-backend stub
  (``nvlab stub-env`` builds it; ``./course`` does).
- ``glibc``: perf_analyzer's wheel needs glibc >= 2.38; Debian 12 has 2.36.
- ``tensorrt_stubs``: tensorrt-stubs 10.13, repaired so that mypy can read it.
- ``triton_interpreter``: triton's interpreter before triton-lang/triton#9171 under NumPy >= 2.4 (loops
  bounded by a kernel argument fail)."""
