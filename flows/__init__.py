"""Prefect flows (pipeline, generation, training, evaluation, retrain) and the `tandem` CLI.
Nothing imports this package but the CLI entry point."""
