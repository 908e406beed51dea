"""Course machinery: the lab catalog, the environment probe, GPU specs, the version manifest, results and sessions."""
