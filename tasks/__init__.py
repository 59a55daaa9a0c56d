"""The domain logic, runnable and tested without Prefect (the flows wrap it in Prefect tasks):
environments and rewards (envs/, envthread.py), rollouts (rollout.py, worker.py), rollout shards
(shards.py) and set-aside groups (failed_groups.py), weight snapshots (snapshots.py), the
generator (generator.py), lag control (lag.py, ledger.py), the lease (lease.py), loss, trainer
step and learner (loss.py, trainer.py, learner.py, warmup.py), checkpoints, metrics and the
report (checkpoints.py, metrics.py, report.py), evaluation and promotion, the run directory
(rundir.py), engine placement (placement.py) and autoscaling (autoscale.py). Imports infra/ and
configs/, never flows/."""
