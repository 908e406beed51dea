"""Lab 05: ``prometheus`` (the server, its configuration and rules, promtool, queries as data frames), ``panels``
(the PromQL of the notebook's plots and the Grafana dashboard), ``drills`` (load phases, health checks, the
watchdog, the failure drill) and ``gpu_exporter`` (GPU and host metrics for Prometheus)."""
