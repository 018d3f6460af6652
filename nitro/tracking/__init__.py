"""MLflow: the per-round metrics, the run's records, the policy as a model, plots, comparisons."""
