"""The generation side: claim admission slots, keep engines on fresh weights, run groups on Dask.

Two halves, split by where they run:

- `Generator` lives in the generation flow's process. It owns the admission state of one
  producer: it reads the trainer's published state, claims slots up to the lag capacity
  (tasks/lag.py), loads the newest snapshot into its engines before work that needs it, and turns
  claimed slots into `GroupSpec`s: small, picklable descriptions of one group's work.
- `generate_group` runs on a Dask worker, one call per group (tasks/worker.py): it plays the
  slot's episodes and commits them as one shard, keyed by producer and slot.

Slot s always maps to the same training prompt (s modulo the prompt count), so a retried slot
regenerates the same prompt and the group id (the slot) is stable across retries.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from configs.schema import RunConfig
from infra.engines.fleet import EngineFleet
from infra.manifest import ManifestError
from infra.modelfactory import load_tokenizer
from infra.storage import open_run_store
from tasks.envs import environment_factory
from tasks.failed_groups import failed_group_slots, set_aside_group
from tasks.lag import SlotClaims, admission_capacity, claim_share, read_trainer_state
from tasks.rollout import check_prompts_fit, model_eos_ids
from tasks.shards import committed_slots, parse_shard_key
from tasks.snapshots import (
    FETCH_PIN_SECONDS, latest_version, load_snapshot, manifest_digest, pin_snapshot, report_rejected, snapshot_prefix,
    snapshot_versions,
)  # fmt: skip
from tasks.worker import GroupResult, GroupSpec

log = logging.getLogger(__name__)
RELOAD_RETRY_SECONDS = 10.0
"""How often a generator tries again to load its version into an engine that failed that load."""
MAX_ABORTS_PER_SLOT = 3
"""Tries of a group aborted while training goes on before its generator gives the slot up."""
REJECTION_RECHECK_SECONDS = 5.0
"""How often a generator looks whether a snapshot it rejected has been committed again."""
FAILED_GROUPS_IN_A_ROW_LIMIT = 32
"""Groups that failed (their environment, or an abort at every try), one after another at a
generator, that stop the run: an environment that fails every episode (a bug, a tool server that is
down) stops it within two chunks or so, where setting each group aside would go through the whole
data set; one that fails now and then (a flaky sandbox) costs only the groups it fails. Counted in
the order groups finish, in which failures that come fast bunch: 8 stopped about 7% of 16-group
chunks at a 30% failure rate; 32 in a row is about 2e-10 at 50%."""
ENGINE_RESTART_MARGIN_SECONDS = 60.0
"""A request's wait for an engine beyond the engines' restart time: the generator notices the
death at its next loop turn, and the client's probe the restarted engine within a second."""


class Generator:
    """One producer's admission state, engines and weights."""

    def __init__(self, config: RunConfig, producer: str, fleet: EngineFleet, cache_dir: Path):
        self.config = config
        self.producer = producer
        self.fleet = fleet
        self.cache_dir = cache_dir
        self.store = open_run_store(config.storage, config.run_id)
        self.claims = SlotClaims(self.store, producer, config.training.prompts_per_step)
        env = environment_factory(config.env.entrypoint, config.env.max_turns, config.env.kwargs)()
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
        version, which the rollout records, says so).

        If no engine loaded the fleet's version, the newest older one an engine serves: admission
        counted the version none of them had, and the generator made groups for slots that need
        it, which the rollouts' own version (the engines') then made stale, every one at max_lag
        0, until a reload took."""
        if self._loading_version is not None:
            return self._loading_version
        versions = self.fleet.engine_versions
        if self.fleet.version in versions:
            return self.fleet.version
        return max((v for v in versions if v < self.fleet.version), default=self.fleet.version)

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
        pin_snapshot(self.store, self.producer, newest, lapse_seconds=FETCH_PIN_SECONDS)
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

    def requeue_unfinished(self, slots: list[int], results: list[GroupResult]) -> tuple[list[int], list[GroupResult]]:
        """Put the `slots` of a finished chunk that have no result (their groups were aborted:
        an engine's or an operator's abort, not this run's end) first in line again; returns
        them, and the results of those set aside (below) for the flow to count as failures. A
        claimed slot is this producer's alone, so left uncommitted it would hold its share of the
        admission window for good and, at max_lag 0, stall the trainer one group short.
        After training has finished they stay claimed, for a continued run to make.

        A slot aborted more than MAX_ABORTS_PER_SLOT times, whose abort every try meets, is set
        aside as a failed group (tasks/failed_groups.py): the trainer counts it lost and admission
        makes another group in its place. Merely left claimed, it held its capacity for as long
        as the generator ran, and at max_lag 0 the trainer waited for it for good."""
        unfinished = sorted(set(slots) - {result.slot for result in results})
        if not unfinished or read_trainer_state(self.store).done:
            return [], []
        self.aborts.update(unfinished)
        given_up = [slot for slot in unfinished if self.aborts[slot] > MAX_ABORTS_PER_SLOT]
        requeued = [slot for slot in unfinished if slot not in given_up]
        self.orphans.extend(requeued)
        return requeued, self._set_aside_aborted(given_up) if given_up else []

    def _set_aside_aborted(self, slots: list[int]) -> list[GroupResult]:
        error = (f"its requests were aborted {MAX_ABORTS_PER_SLOT + 1} times: an abort that every try meets (a prompt "
                 "longer than the engines' context or KV cache? an operator's abort_request?)")  # fmt: skip
        committed = set(committed_slots(self.store))  # a concurrent try of its chunk may have made it: it stands
        set_aside = []
        for slot in [s for s in slots if s not in committed]:
            prompt, now = self.prompts[slot % len(self.prompts)], time.time()
            record = {"slot": slot, "producer": self.producer, "prompt_id": prompt.prompt_id, "env": self.config.env.entrypoint,
                      "error": error, "failed_at": now}  # fmt: skip
            key = set_aside_group(self.store, slot, record)
            set_aside.append(GroupResult(slot, key, True, 0, 0.0, self.loaded_version, now, now, failure=error))
        return set_aside

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
            pin_snapshot(store, consumer, version, lapse_seconds=FETCH_PIN_SECONDS)
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
