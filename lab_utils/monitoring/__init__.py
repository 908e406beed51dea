"""Lab 05: Prometheus (process, configuration, queries), the GPU exporter, panels, alerts and failure drills."""
