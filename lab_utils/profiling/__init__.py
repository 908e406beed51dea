"""Lab 06: reading profiler traces, planted bottlenecks, memory and error diagnostics, Nsight runners."""
