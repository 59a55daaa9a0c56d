"""Prefect tasks and the domain logic they run: rollouts, environments and rewards, rollout shards
(shards.py), weight snapshots, lag control, loss, trainer step and metrics. Every task wraps a
plain function that runs and is tested without Prefect. Imports infra/ and configs/, never flows/."""
