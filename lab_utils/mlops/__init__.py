"""Lab 08's lifecycle helpers: an owned MLflow tracking server and the registry's lineage (``tracking``), canary
decisions driven by Prometheus (``canary``) on labelled feedback (``feedback``), A/B routing and statistics
(``abtest``), drift statistics and their exporter (``drift``), the retraining pipeline (``pipeline``) and the
lifecycle map (``lifecycle``).

Importing this package starts nothing and imports neither torch nor mlflow; each module imports what it needs."""
