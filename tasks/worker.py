"""What runs on a Dask worker: one group's episodes and its commit, and what a worker keeps.

- `GroupSpec`, `GroupResult`: a group's work as the generation flow hands it out (small and
  picklable), and what came of it.
- `generate_group`, one call per group: it plays `samples` episodes of the slot's prompt against
  the engines (tasks/rollout.py) and commits them as one shard, keyed by producer and slot. A
  retried group first looks for its own shard and, if it is committed, returns it instead of
  generating again: a slot is written once, whatever fails around it. A group its environment
  fails is set aside (tasks/failed_groups.py), once, whichever try of it fails first.
- The worker's state across groups: one event loop, one engine client per engine set, and the
  run's tokenizer (`release_worker_state` lets them go when a run ends).

tasks/generator.py is the other half, in the generation flow's process: admission, weights, and
the specs it hands out.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from configs.sections import StorageConfig
from infra.engines.api import SamplingParams
from infra.engines.client import EngineClient
from infra.modelfactory import load_tokenizer
from infra.scratch import scratch_dir
from infra.storage import RunStore, open_run_store
from tasks.envs import Prompt, environment_factory
from tasks.envthread import EnvironmentFailed
from tasks.failed_groups import failed_group_key, set_aside_group
from tasks.lag import read_trainer_state
from tasks.rollout import PromptTooLong, run_group
from tasks.shards import shard_key, write_shard
from tasks.snapshots import latest_version, load_snapshot


@dataclass(frozen=True)
class GroupSpec:
    """Everything a Dask worker needs to generate and commit one group."""

    slot: int
    prompt: Prompt
    producer: str
    loaded_version: int
    engine_urls: tuple[str, ...]
    oldest_engine_version: int
    """The oldest version an engine served when the group was handed out (`_committed_shard`)."""
    run_id: str
    storage: StorageConfig
    env_entrypoint: str
    env_kwargs: dict = field(default_factory=dict)
    max_turns: int = 2
    env_timeout_s: float = 600.0
    samples: int = 8
    sampling: dict = field(default_factory=dict)
    context_length: int = 64
    api_key: str | None = None
    request_timeout: float = 120.0
    retry_seconds: float = 60.0
    """How long a request waits for an engine to answer again: the engines' restart and more, so
    that a crashed engine (the only one, by default) fails no group while the generator starts it
    again. Shorter, a chunk's groups and its retries were spent within it and the run stopped."""
    hand_off_stragglers: bool = True


@dataclass(frozen=True)
class GroupResult:
    """What came of one group: its shard and a few numbers for metrics."""

    slot: int
    key: str
    created: bool
    samples: int
    reward_mean: float
    policy_version: int
    started_at: float
    """Wall time (epoch seconds) the group started and finished: the generator's busy intervals."""
    finished_at: float
    tokens: int = 0
    """Tokens the model generated in the group (its loss-mask tokens)."""
    failure: str | None = None
    """Why the group failed (its environment, or an abort at every try) and was set aside
    (`key`: its record's, tasks/failed_groups.py) instead of committed; None for a committed group."""


def generate_group(spec: GroupSpec) -> GroupResult | None:
    """Play one group and commit its shard (runs on a Dask worker).

    None: the run's training finished before the group started, or while it played (the
    generation flow then aborts the engines' requests, so that a finished run does not wait for
    up to max_lag + 1 batches nobody will train), or an abort ended one of its episodes. Its slot
    stays claimed and uncommitted: a continued run regenerates it first, and during the run the
    generator does (`Generator.requeue_unfinished`); a half-played group is never committed.
    A group its environment failed is set aside (`_set_aside`): its result says why."""
    started = time.time()
    store = open_run_store(spec.storage, spec.run_id)
    if (done_before := _done_by_another_try(store, spec, started)) is not None:
        return done_before
    if read_trainer_state(store).done:
        return None
    tokenizer = _tokenizer(store)
    make_env = environment_factory(spec.env_entrypoint, spec.max_turns, spec.env_kwargs)

    async def play():
        client = await _engine_client(spec)
        return await run_group(
            client, make_env, spec.prompt, spec.samples,
            tokenizer, SamplingParams(**spec.sampling), max_turns=spec.max_turns,
            context_length=spec.context_length, loaded_version=spec.loaded_version,
            group_id=f"s{spec.slot:08d}", producer=spec.producer, env_timeout_s=spec.env_timeout_s,
        )  # fmt: skip

    try:
        rollouts = asyncio.run_coroutine_threadsafe(play(), _worker_loop()).result()
    except (EnvironmentFailed, PromptTooLong) as failure:
        return _set_aside(store, spec, failure, started)
    if any(r.finish_reason == "abort" for r in rollouts):
        return None
    if store.exists(failed_group_key(spec.slot)):  # another try of its chunk failed it meanwhile: counted lost
        return _done_by_another_try(store, spec, started)
    written = write_shard(store, rollouts, spec.producer, spec.slot, context_length=spec.context_length)
    rewards = [r.reward for r in rollouts]
    return GroupResult(
        spec.slot, written.key, written.created, len(rollouts), sum(rewards) / len(rewards),
        min(r.policy_version for r in rollouts), started, time.time(), sum(sum(r.loss_mask) for r in rollouts),
    )  # fmt: skip


def _set_aside(store: RunStore, spec: GroupSpec, failure: Exception, started: float) -> GroupResult:
    """Set aside a group its environment failed (tasks/failed_groups.py): the trainer counts it
    lost, generators make another group in its place, and its slot is spent, so that its prompt,
    which may fail every time, is not played again. The user's environment is not the run's to
    crash: a tool that fails now and then costs its groups only (the generation flow stops a run
    whose environment fails group after group: FAILED_GROUPS_IN_A_ROW_LIMIT)."""
    if (done_before := _done_by_another_try(store, spec, started)) is not None:  # committed meanwhile: it stands
        return done_before
    record = {"slot": spec.slot, "producer": spec.producer, "prompt_id": spec.prompt.prompt_id, "env": spec.env_entrypoint,
              "error": str(failure), "traceback": "".join(traceback.format_exception(failure)), "failed_at": time.time()}  # fmt: skip
    key = set_aside_group(store, spec.slot, record)
    return GroupResult(spec.slot, key, True, 0, 0.0, spec.loaded_version, started, time.time(), failure=str(failure))


def _done_by_another_try(store: RunStore, spec: GroupSpec, started: float) -> GroupResult | None:
    """The result of slot `spec.slot` if a try of its chunk already committed its group or set
    it aside, else None. A chunk that fails is retried while its other groups may still play
    (Dask does not stop them), so two tries of a group can run at once: each looks before it
    plays, and again before it commits or sets aside, so that a slot is not both trained and
    counted lost (which would admit one group past the window) but in the milliseconds between
    a look and a write."""
    if (existing := _committed_shard(store, spec)) is not None:
        return GroupResult(spec.slot, existing, False, spec.samples, 0.0, -1, started, time.time())
    if store.exists(failed_key := failed_group_key(spec.slot)):
        return GroupResult(spec.slot, failed_key, False, 0, 0.0, spec.loaded_version, started, time.time(),
                           failure="the environment failed it in another try of its chunk")  # fmt: skip
    return None


def _committed_shard(store, spec: GroupSpec) -> str | None:
    """The key of this producer's shard for this slot if a previous attempt committed it.

    A shard's key carries its rollouts' own policy version, the engines' report: from
    `loaded_version` up, or older on an engine that failed a load (it keeps serving its own
    weights; a load that timed out may have finished later, so anything from the oldest the
    fleet recorded). Searching from `loaded_version` alone missed that commit, and a retry on an
    engine that had loaded since committed the slot a second time, under another key."""
    newest = latest_version(store) or 0
    for version in range(min(spec.oldest_engine_version, spec.loaded_version), newest + 1):
        key = shard_key(version, spec.producer, spec.slot)
        if store.exists(key):
            return key
    return None


_LOOP: asyncio.AbstractEventLoop | None = None
_CLIENTS: dict[tuple, EngineClient] = {}
_LOOP_LOCK = threading.Lock()


def _worker_loop() -> asyncio.AbstractEventLoop:
    """This worker process's event loop, in a daemon thread, started on first use.

    Every group a worker runs, from any of its threads, plays its episodes on this one loop
    through one `EngineClient` per engine set. A loop and client per group cost more CPU than
    the episodes' own Python work (a connection pool, a TLS context and a health prober made
    and torn down for every 8 episodes), and per-group clients could not share what they learn
    about a dead engine."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="tandem-episodes", daemon=True).start()
        return _LOOP


async def _engine_client(spec: GroupSpec) -> EngineClient:
    """The worker's client for `spec`'s engines (made on the worker loop, kept for later groups)."""
    key = (spec.engine_urls, spec.api_key, spec.request_timeout, spec.retry_seconds, spec.hand_off_stragglers)
    client = _CLIENTS.get(key)
    if client is None:
        client = _CLIENTS[key] = EngineClient(
            list(spec.engine_urls), api_key=spec.api_key, request_timeout=spec.request_timeout,
            retry_seconds=spec.retry_seconds, hand_off_stragglers=spec.hand_off_stragglers,
        )  # fmt: skip
        await client.__aenter__()
    return client


_TOKENIZERS: dict[str, PreTrainedTokenizerBase] = {}
_TOKENIZER_LOCK = threading.Lock()


def _tokenizer(store: RunStore) -> PreTrainedTokenizerBase:
    """The run's tokenizer, fetched once per worker process from snapshot v0 (verified), without
    the weights beside it.

    One fetch per process (the lock) into a scratch directory of its own, removed once the
    tokenizer is in memory: a worker runs several groups in threads, and several workers share
    the machine."""
    with _TOKENIZER_LOCK:
        if store.url not in _TOKENIZERS:
            with scratch_dir("tandem-tokenizer-") as cache:
                _TOKENIZERS[store.url] = load_tokenizer(load_snapshot(store, cache, version=0, weights=False))
        return _TOKENIZERS[store.url]


def release_worker_state(engine_urls: tuple[str, ...], store_url: str) -> int:
    """Close this worker's clients of `engine_urls` and forget `store_url`'s tokenizer; returns
    how many clients it closed. Run on every worker when a generation run ends (flows/generation.py
    `worker_state_released`): the workers of a long-lived cluster serve run after run, and kept
    every run's clients (an HTTP session each, and once a request had failed, a probe of the
    run's engines, gone, twice a second) and tokenizer for as long as they lived."""
    with _TOKENIZER_LOCK:
        _TOKENIZERS.pop(store_url, None)
    with _LOOP_LOCK:
        loop = _LOOP
    if loop is None:  # no group ran here
        return 0

    async def close_clients() -> int:  # on the loop that owns the clients
        clients = [_CLIENTS.pop(key) for key in list(_CLIENTS) if key[0] == engine_urls]
        await asyncio.gather(*(client.close() for client in clients))
        return len(clients)

    return asyncio.run_coroutine_threadsafe(close_clients(), loop).result(timeout=30)
