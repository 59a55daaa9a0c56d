"""The domain logic, runnable and tested without Prefect (the flows wrap it in Prefect tasks):
rollouts, environments and rewards, rollout shards (shards.py), weight snapshots, lag control,
loss, trainer step, checkpoints and metrics. Imports infra/ and configs/, never flows/."""
