"""The evaluation flow: score one pinned snapshot on the held-out prompts, beside training.

It starts its own engine on the snapshot (pinned, so retention keeps it while it is read),
runs greedy episodes through the same rollout code as training, and appends the score to
metrics/evaluation.jsonl and to the run's evaluation artifact.
"""

from __future__ import annotations

import asyncio

from prefect import flow

from configs.schema import RunConfig
from flows.ui import publish_evaluation
from infra.engines.client import EngineClient
from infra.engines.fleet import EngineFleet
from infra.scratch import scratch_dir
from infra.storage import open_run_store
from tasks.evaluation import evaluate
from tasks.metrics import MetricsLog
from tasks.snapshots import committed_version, load_snapshot, pin_snapshot, unpin_snapshot


@flow(name="evaluation", log_prints=True)
def evaluation(config: RunConfig, version: int | None = None) -> dict:
    """Greedy score of snapshot `version` (default: LATEST) on the held-out prompts."""
    if not config.env.eval_prompts:
        raise ValueError(f"run {config.run_id} has no held-out prompts (env.eval_prompts is 0): nothing to evaluate")
    store = open_run_store(config.storage, config.run_id)
    if version is None:
        version = committed_version(store, None)  # SnapshotMissing when nothing is published
    consumer = f"eval-v{version}"
    # Before the check: retention keeps what it then finds. It lapses, so that a run killed
    # before its `finally` does not keep the snapshot for good: the fetch takes minutes, not hours.
    pin_snapshot(store, consumer, version, lapse_seconds=config.prefect.evaluation_pin_hours * 3600)
    try:
        committed_version(store, version)
        with scratch_dir("tandem-eval-") as cache:
            model_dir = load_snapshot(store, cache, version)
            # On a free port: the machine's generators may hold engine.base_port's range.
            with EngineFleet(config.engine.model_copy(update={"base_port": 0}), 1, model_dir, version, cache / "logs") as fleet:

                async def score() -> dict:
                    # engine.request_timeout_s, as in generation: the client's default (120 s) failed
                    # the evaluation of long answers queued 64 at a time on one engine.
                    async with EngineClient(fleet.urls, api_key=fleet.api_key, request_timeout=config.engine.request_timeout_s) as client:
                        return await evaluate(client, model_dir, config, version)

                result = asyncio.run(score())
    finally:
        unpin_snapshot(store, consumer)
    metrics = MetricsLog(store, "evaluation", flush_seconds=0)
    metrics.log("evaluation", **result)
    publish_evaluation(config.run_id, result)
    failed = f" ({result['failed']} left out: the environment failed them)" if result["failed"] else ""
    print(f"v{version}: score {result['score']:.3f}, solved {result['solved']:.1%} of {result['prompts']} held-out prompts{failed}")
    return result
