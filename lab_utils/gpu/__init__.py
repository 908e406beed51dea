"""Lab 01: CUDA and cuBLAS benchmarks (timing, matmul and copy sweeps, launch overhead) and their plots."""
