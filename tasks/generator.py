"""The generation side: claim admission slots, keep engines on fresh weights, run groups on Dask.

Two halves, split by where they run:

- `Generator` lives in the generation flow's process. It owns the admission state of one
  producer: it reads the trainer's published state, claims slots up to the lag capacity
  (tasks/lag.py), loads the newest snapshot into its engines before work that needs it, and turns
  claimed slots into `GroupSpec`s: small, picklable descriptions of one group's work.
- `generate_group` runs on a Dask worker, one call per group: it plays `samples` episodes of the
  slot's prompt against the engines (tasks/rollout.py) and commits them as one shard, keyed by
  producer and slot. A worker plays all its groups on one event loop with one engine client.
  A retried group first looks for its own shard and, if it is committed, returns it instead of
  generating again: a slot is written once, whatever fails around it.

Slot s always maps to the same training prompt (s modulo the prompt count), so a retried slot
regenerates the same prompt and the group id (the slot) is stable across retries.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from configs.schema import RunConfig, StorageConfig
from infra.engines.api import SamplingParams
from infra.engines.client import EngineClient
from infra.engines.fleet import EngineFleet
from infra.manifest import ManifestError
from infra.scratch import scratch_dir
from infra.modelfactory import load_tokenizer
from infra.storage import RunStore, open_run_store
from tasks.envs import Prompt, load_environment
from tasks.lag import SlotClaims, admission_capacity, claim_share, read_trainer_state
from tasks.envthread import EnvironmentFailed
from tasks.failed_groups import failed_group_key, failed_group_slots, set_aside_group
from tasks.rollout import PromptTooLong, check_prompts_fit, model_eos_ids, run_group
from tasks.shards import committed_slots, parse_shard_key, shard_key, write_shard
from tasks.snapshots import (
    latest_version, load_snapshot, manifest_digest, pin_snapshot, report_rejected, snapshot_prefix, snapshot_versions,
)  # fmt: skip

log = logging.getLogger(__name__)
RELOAD_RETRY_SECONDS = 10.0
"""How often a generator tries again to load its version into an engine that failed that load."""
MAX_ABORTS_PER_SLOT = 3
"""Tries of a group aborted while training goes on before its generator gives the slot up."""
REJECTION_RECHECK_SECONDS = 5.0
"""How often a generator looks whether a snapshot it rejected has been committed again."""
FAILED_GROUPS_IN_A_ROW_LIMIT = 32
"""Groups whose environment failed, one after another at a generator, that stop the run: an
environment that fails every episode (a bug, a tool server that is down) stops it within two
chunks or so, where setting each group aside would go through the whole data set; one that fails
now and then (a flaky sandbox) costs only the groups it fails. Counted in the order groups finish,
in which failures that come fast bunch: 8 stopped about 7% of 16-group chunks at a 30% failure
rate; 32 in a row is about 2e-10 at 50%."""
ENGINE_RESTART_MARGIN_SECONDS = 60.0
"""A request's wait for an engine beyond the engines' restart time: the generator notices the
death at its next loop turn, and the client's probe the restarted engine within a second."""


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
    """Why the environment failed the group, which was set aside (`key`: its record's,
    tasks/failed_groups.py) instead of committed; None for a committed group."""


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
    existing = _committed_shard(store, spec)
    if existing is not None:
        return GroupResult(spec.slot, existing, False, spec.samples, 0.0, -1, started, time.time())
    if store.exists(failed_key := failed_group_key(spec.slot)):  # set aside by an earlier try of its chunk
        return GroupResult(spec.slot, failed_key, False, 0, 0.0, spec.loaded_version, started, time.time(),
                           failure="the environment failed it in an earlier try of its chunk")  # fmt: skip
    if read_trainer_state(store).done:
        return None
    tokenizer = _tokenizer(store)
    env_cls = load_environment(spec.env_entrypoint)

    async def play():
        client = await _engine_client(spec)
        return await run_group(
            client, lambda: env_cls(max_turns=spec.max_turns, **spec.env_kwargs), spec.prompt, spec.samples,
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
    record = {"slot": spec.slot, "producer": spec.producer, "prompt_id": spec.prompt.prompt_id, "env": spec.env_entrypoint,
              "error": str(failure), "traceback": "".join(traceback.format_exception(failure)), "failed_at": time.time()}  # fmt: skip
    key = set_aside_group(store, spec.slot, record)
    return GroupResult(spec.slot, key, True, 0, 0.0, spec.loaded_version, started, time.time(), failure=str(failure))


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
    """The run's tokenizer, fetched once per worker process from snapshot v0 (verified).

    One fetch per process (the lock) into a scratch directory of its own, removed once the
    tokenizer is in memory: a worker runs several groups in threads, and several workers share
    the machine."""
    with _TOKENIZER_LOCK:
        if store.url not in _TOKENIZERS:
            with scratch_dir("tandem-tokenizer-") as cache:
                _TOKENIZERS[store.url] = load_tokenizer(load_snapshot(store, cache, version=0))
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


class Generator:
    """One producer's admission state, engines and weights."""

    def __init__(self, config: RunConfig, producer: str, fleet: EngineFleet, cache_dir: Path):
        self.config = config
        self.producer = producer
        self.fleet = fleet
        self.cache_dir = cache_dir
        self.store = open_run_store(config.storage, config.run_id)
        self.claims = SlotClaims(self.store, producer, config.training.prompts_per_step)
        env = load_environment(config.env.entrypoint)(max_turns=config.env.max_turns, **config.env.kwargs)
        self.prompts = env.prompts("train", config.env.train_prompts, config.seed)
        committed = committed_slots(self.store)
        self.committed_at_start = {slot: key for slot, key in committed.items() if parse_shard_key(key).producer == producer}
        """Slot -> key of every group this producer committed before this start (an earlier life's)."""
        self._loading_version: int | None = None
        """The version the engines are paused to load, while `refresh_weights` runs its caller's
        `while_loading`; None otherwise."""
        self.model_eos = model_eos_ids(fleet.model_dir)
        """The model's own end tokens, which end a turn besides the tokenizer's (tasks/rollout.py)."""
        check_prompts_fit(self.prompts, load_tokenizer(fleet.model_dir), config.model.max_position_embeddings)
        self.rejected_snapshots: dict[int, str | None] = {}
        """Version -> manifest digest of the commit that failed verification: not tried again
        until the version is committed anew (tasks/snapshots.py `recommit_snapshot`)."""
        self._rejections_checked_at = 0.0
        self._reloaded_at, self._reload_failures = 0.0, 0
        self.aborts: Counter[int] = Counter()
        """Slot -> how often its group was aborted while training went on (`requeue_unfinished`)."""
        self.orphans = self.claims.claimed_by_me(exclude=set(committed) | set(failed_group_slots(self.store)))
        """Slots an earlier life of this producer claimed but never committed (it died with them
        in flight). They are generated first: left alone, the capacity they hold would leak,
        and a leak of more than max_lag batches stalls the run."""

    @property
    def loaded_version(self) -> int:
        """The weights that work started now runs on: the fleet's, or, while the engines are
        paused for a load, the version being loaded (what is sent meanwhile waits for it; on an
        engine whose load fails it runs on the old weights, and the engine's own report of the
        version, which the rollout records, says so)."""
        return self.fleet.version if self._loading_version is None else self._loading_version

    def refresh_weights(self, while_loading: Callable[[], object] | None = None) -> dict[str, float] | None:
        """Load the newest committed snapshot into the engines if it is another than theirs:
        newer, or older when a restarted run withdrew the engines' version with the other
        snapshots after its checkpoint (tasks/lag.py `reopen_run`). None if there was none to
        load, else where the time went: `fetch_seconds` (download and verify),
        `pause_seconds` (every engine confirming a pause), `load_seconds` (from then until every
        engine has loaded and continued) and `start_seconds` (`while_loading`, during the load).
        The local copy of the weights loaded before is removed: only the engines' current
        version stays on this machine's disk.

        `while_loading` (the flow's "start what admission allows") runs once every engine has
        confirmed a pause, beside the load (a thread), with `loaded_version` already the new
        version: the work it sends waits in the engines' queues and runs on the new weights
        from its first token, and its start (a Prefect task run, Dask, the groups' set-up:
        0.1-0.25 s) overlaps the load instead of following it. In a synchronous run that start
        was on every step's critical path; with work in flight the pause is no longer than
        before. If any engine did not confirm the pause, work could start there on the old
        weights under the new version's name, so `while_loading` is not called and the caller
        starts its work after the load.

        A snapshot that fails verification (damaged after its commit: a file truncated or
        changed) raises `SnapshotRejected` once, is reported to the trainer, and is skipped
        until it is committed again (tasks/snapshots.py `recommit_snapshot`). The engines keep
        the weights they have meanwhile. Crashing here instead would take the whole generation
        side down for one bad object. A disk too full for the fetch is this machine's trouble,
        not the snapshot's: its OSError (ENOSPC) is raised, and the generation run fails naming
        the bytes it needs, rather than skip every snapshot. With nothing new to load, engines
        that failed the last load are given it again (`_reload_engines_behind`)."""
        newest = latest_version(self.store)
        if newest == self.fleet.version:
            self._reload_engines_behind()
            return None
        if newest is None or not self._worth_fetching(newest):
            return None
        began = time.monotonic()
        previous = self.fleet.model_dir
        pin_snapshot(self.store, self.producer, newest)
        try:
            local = load_snapshot(self.store, self.cache_dir / "weights", newest)
        except ManifestError as err:
            if newest not in snapshot_versions(self.store):
                return None  # withdrawn meanwhile (tasks/lag.py `reopen_run`): LATEST says what replaces it
            self.rejected_snapshots[newest] = err.manifest_digest  # the commit checked, not one made since
            report_rejected(self.store, self.producer, newest, err.manifest_digest, str(err))
            raise SnapshotRejected(newest, str(err)) from err
        fetched = time.monotonic()
        paused = while_loading is not None and self.fleet.pause()
        loading = time.monotonic()
        starting = loading
        with ThreadPoolExecutor(1, thread_name_prefix="tandem-weight-load") as pool:
            load = pool.submit(lambda: (self.fleet.update_weights(local, newest), time.monotonic()))  # pauses again, loads, continues
            if paused:
                self._loading_version = newest
                try:
                    while_loading()
                finally:  # leaving the pool waits for the load, so the engines are continued also after an error
                    self._loading_version = None
                    starting = time.monotonic()
            results, loaded = load.result()
        failed = [r for r in results if not r.ok]
        if failed:  # `_reload_engines_behind` tries them again
            log.warning("engines failed to load v%d: %s", newest, [(r.url, r.message) for r in failed])
            self._reloaded_at = time.monotonic()
        if previous.parent == self.cache_dir / "weights":  # engines restart on the new files; a
            shutil.rmtree(previous, ignore_errors=True)  # real model's every version would fill the disk
        return {"fetch_seconds": fetched - began, "pause_seconds": loading - fetched,
                "load_seconds": loaded - loading, "start_seconds": starting - loading}  # fmt: skip

    def _reload_engines_behind(self) -> None:
        """Try again the load of the fleet's version into the engines that failed it: they serve
        older weights until then, which the lag bound may soon drop (or, where no newer snapshot
        comes, for good). After `RELOAD_RETRY_SECONDS`, doubled after each try that failed, up
        to ten minutes: a load that keeps failing holds this loop up for its timeout each time."""
        if all(version == self.fleet.version for version in self.fleet.engine_versions):
            self._reload_failures = 0
            return
        if time.monotonic() - self._reloaded_at < min(600.0, RELOAD_RETRY_SECONDS * 2**self._reload_failures):
            return
        results = self.fleet.reload_behind()
        self._reloaded_at = time.monotonic()
        self._reload_failures = 0 if all(r.ok for r in results) else self._reload_failures + 1
        log.warning("loaded v%d again into the engines that failed it: %s", self.fleet.version, [(r.url, r.ok, r.message) for r in results])

    def _worth_fetching(self, version: int) -> bool:
        """False for a version rejected before, until its manifest shows a new commit of it
        (looked at every `REJECTION_RECHECK_SECONDS`: a small read, where a fetch is the
        whole model)."""
        if version not in self.rejected_snapshots:
            return True
        if time.monotonic() - self._rejections_checked_at < REJECTION_RECHECK_SECONDS:
            return False
        self._rejections_checked_at = time.monotonic()
        if manifest_digest(self.store, version) in (None, self.rejected_snapshots[version]):
            return False
        del self.rejected_snapshots[version]
        return True

    def requeue_unfinished(self, slots: list[int], results: list[GroupResult]) -> list[int]:
        """Put the `slots` of a finished chunk that have no result (their groups were aborted:
        an engine's or an operator's abort, not this run's end) first in line again, and return
        them. A claimed slot is this producer's alone, so left uncommitted it would hold its share
        of the admission window for good and, at max_lag 0, stall the trainer one group short.
        After training has finished they stay claimed, for a continued run to make; so does a
        slot aborted more than MAX_ABORTS_PER_SLOT times, whose abort every try meets."""
        unfinished = sorted(set(slots) - {result.slot for result in results})
        if not unfinished or read_trainer_state(self.store).done:
            return []
        self.aborts.update(unfinished)
        given_up = [slot for slot in unfinished if self.aborts[slot] > MAX_ABORTS_PER_SLOT]
        if given_up:
            print(f"{self.producer}: groups of slots {given_up} were aborted {MAX_ABORTS_PER_SLOT + 1} times: not generated "
                  "again in this run of the generator (an abort that every try meets: a prompt longer than the engines' "
                  "context or KV cache?); they hold admission capacity until a restart generates them")  # fmt: skip
        requeued = [slot for slot in unfinished if slot not in given_up]
        self.orphans.extend(requeued)
        return requeued

    def claim_specs(self, most: int, held: int = 0, producers: int = 1, new_claims: bool = True) -> list[GroupSpec]:
        """Up to `most` slots to generate: this producer's orphans first, then (unless
        `new_claims` is False: the producer is retiring) new claims that admission allows on
        the loaded weights (maybe none). With `held` groups already in flight, it takes no more
        than its share of the admission window among `producers` live generators
        (tasks/lag.py `claim_share`)."""
        state = read_trainer_state(self.store)
        if state.done:
            return []
        lag, per_step = self.config.lag.max_lag, self.config.training.prompts_per_step
        # What admission allows on the weights loaded, which may be older than the trainer's: a
        # slot past it would need newer weights (the bound, not a check of the next free slot,
        # since other generators may take the slots up to the one this claim gets).
        capacity = admission_capacity(min(state.version, self.loaded_version), lag, per_step, state.lost_groups)
        most = min(most, claim_share(lag, per_step, producers) - held)
        specs = [self.spec(self.orphans.pop(0)) for _ in range(min(most, len(self.orphans)))]
        while new_claims and len(specs) < most:
            slot = self.claims.claim(capacity)
            if slot is None:
                break
            specs.append(self.spec(slot))
        return specs

    def spec(self, slot: int) -> GroupSpec:
        gen, cfg = self.config.generation, self.config
        sampling = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k, "max_new_tokens": gen.max_new_tokens,
                    "stop_token_ids": self.model_eos}  # fmt: skip
        return GroupSpec(
            slot=slot, prompt=self.prompts[slot % len(self.prompts)], producer=self.producer,
            loaded_version=self.loaded_version, engine_urls=tuple(self.fleet.urls),
            oldest_engine_version=min(self.fleet.engine_versions), run_id=cfg.run_id,
            storage=cfg.storage, env_entrypoint=cfg.env.entrypoint, env_kwargs=dict(cfg.env.kwargs),
            max_turns=cfg.env.max_turns, env_timeout_s=cfg.env.step_timeout_s, samples=gen.samples_per_prompt, sampling=sampling,
            context_length=cfg.model.max_position_embeddings, api_key=self.fleet.api_key,
            request_timeout=cfg.engine.request_timeout_s, retry_seconds=self.fleet.restart_seconds + ENGINE_RESTART_MARGIN_SECONDS,
            hand_off_stragglers=gen.hand_off_stragglers,
        )  # fmt: skip


def snapshot_dir_for_engines(config: RunConfig, cache_dir: Path, consumer: str) -> tuple[Path, int]:
    """The newest snapshot that verifies, as a local directory, to start engines on: a damaged
    newest one is passed over for the one before it (v0 is never retired). Each is pinned for
    `consumer` before its fetch: a generator joining mid-run fetched LATEST unpinned, a few
    publishes retired it meanwhile, and the missing files were reported as damage. One retired
    all the same (by a retention pass begun before the pin) sends it back to LATEST."""
    store = open_run_store(config.storage, config.run_id)
    while True:
        latest = latest_version(store)
        if latest is None:
            raise FileNotFoundError(f"no snapshot under {store.url_of(snapshot_prefix(0))}: run `tandem init` first")
        rejected = []
        for version in sorted((v for v in snapshot_versions(store) if v <= latest), reverse=True):
            pin_snapshot(store, consumer, version)
            try:
                return load_snapshot(store, cache_dir / "weights", version), version
            except ManifestError as err:
                if version not in snapshot_versions(store):
                    break  # retired while fetched: LATEST names a newer one
                rejected.append(f"v{version}: {err}")
                log.warning("snapshot v%d failed verification, trying an older one: %s", version, err)
        else:
            raise ManifestError(f"no snapshot of {store.url} verifies: {'; '.join(rejected)}")


class SnapshotRejected(Exception):
    """The newest snapshot failed verification; the engines stay on the weights they have."""

    def __init__(self, version: int, reason: str):
        super().__init__(f"snapshot v{version} rejected: {reason}")
        self.version, self.reason = version, reason
