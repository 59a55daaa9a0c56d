"""The training side's loop: admit a batch from the run directory, step, publish, checkpoint.

`Learner` is what the training flow runs, one `train_step` per Prefect task run. Each step:

1. `admit_batch` lists shards from the lag window's floor V - max_lag on (a few prefix
   listings), and gives a version directory that falls out of the window one last look,
   dropping what is left there as stale, as it does with the groups generators report as
   committed after that look (tasks/lag.py "Late groups"). Groups are picked oldest first (tasks/lag.py
   `select_batch`), read and validated; a bad shard goes to quarantine and another group
   takes its place, as a group that a generator set aside when it failed (its environment, or
   an abort at every try: tasks/failed_groups.py) does; with training.dynamic_sampling a group whose rewards are all one is
   dropped, and another takes its place. It waits (polling, counted as idle time) until
   `prompts_per_step` trainable groups are there, and while a batch would take younger groups before the
   last-chance groups still in flight (tasks/lag.py `waits_for_last_chance`).
2. Group-normalised advantages, one RL optimizer step (tasks/trainer.py): V becomes V+1.
3. Every `publish_every` steps a snapshot; then the trainer state (version, groups lost) that
   generators size their admission by; every `checkpoint_every` steps the metrics are flushed
   and a checkpoint with the ledger is saved.

The ledger (tasks/ledger.py) records every shard key the learner has disposed of and its fate.
It is saved in each checkpoint, so a restarted trainer resumes at the checkpoint's step knowing exactly which shards that lineage of weights has seen:
none is trained twice, and none that it had not trained is skipped. The snapshots the dead trainer
published after that checkpoint were withdrawn before it resumed (tasks/lag.py `reopen_run`), and
shards generated on them, whose version is then ahead of the trainer's, are quarantined as from
the future and generated again.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from configs.fields import MAX_SLOTS
from configs.schema import RunConfig
from infra.manifest import ManifestError
from infra.storage import RunStore
from tasks.checkpoints import (
    CheckpointDamaged, apply_checkpoint_retention, latest_checkpoint_step, load_checkpoint, save_checkpoint, set_aside_checkpoint,
)  # fmt: skip
from tasks.failed_groups import failed_group_slots
from tasks.ledger import LEDGER_KEY, LOST_FATES, Ledger
from tasks.lag import (
    Candidate, TrainerState, forget_late, groups_in_flight, lag_of, late_shard_keys, publish_trainer_state, select_batch,
    waits_for_last_chance,
)  # fmt: skip
from tasks.loss import group_advantages
from tasks.metrics import MetricsLog
from tasks.shards import ValidShards, list_shards, parse_shard_key, quarantine_shard, quarantined_keys, read_valid_shards, table_to_rollouts
from tasks.snapshots import (
    apply_retention, latest_version, load_snapshot, manifest_digest, publish_snapshot, read_rejection_report, recommit_snapshot,
    rejection_reports, snapshot_versions,
)  # fmt: skip
from tasks.trainer import Trainer, build_batch

log = logging.getLogger(__name__)

REPAIR_AFTER_WAIT_SECONDS = 20.0
"""How long an admission waits before the trainer answers reports of a damaged snapshot."""
MAX_RECOMMITS = 3
"""How many times the trainer commits one version again after generators found it damaged."""
LATE_CHECK_SECONDS = 5.0
"""How often a waiting trainer looks for groups reported late and for groups set aside in
quarantine: also at the start of every admit,
so a late group is counted lost within a step, or within this while the trainer waits (a stall
that late groups cause is one where it waits)."""


def without_signal(group: pa.Table) -> bool:
    """Whether every sample of the group got one reward: GRPO gives it advantage 0, no gradient."""
    return pc.min(group["reward"]).as_py() == pc.max(group["reward"]).as_py()


class Learner:
    """Trains on shards as generators commit them, within the lag bound."""

    def __init__(self, config: RunConfig, store: RunStore, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 cache_dir: Path, metrics: MetricsLog, ref_model: PreTrainedModel | None = None,
                 publish_dtype: torch.dtype | None = None):  # fmt: skip
        """`ref_model`: the policy the KL term measures against, needed when training.kl_coef > 0.
        `publish_dtype`: the dtype snapshots are stored in (the initial checkpoint's; `model`
        holds float32 masters of it, see `load_trainable_model`), None for the model's own."""
        self.config = config
        self.store = store
        self.tokenizer = tokenizer
        self.cache_dir = cache_dir
        self.metrics = metrics
        self.ref_model = ref_model
        self.publish_dtype = publish_dtype
        self.trainer = Trainer(model, config.training, ref_model=ref_model, sampling_temperature=config.generation.temperature)
        self.ledger = Ledger()
        self.window_floor = 0
        self.idle_seconds = 0.0
        self.busy_seconds = 0.0
        self.wait_seconds = 0.0
        """How long the last admit_batch took: the idle interval before the step."""
        self.recommits: Counter[int] = Counter()
        """Version -> times committed again after generators found it damaged."""
        self.verified_snapshots: set[str] = set()
        """Manifest digests of snapshots reported damaged that verified here."""
        self._unfinished: tuple[set[str], dict] | None = None
        """The shards and figures of a step applied whose publish or checkpoint has not succeeded."""
        self._without_signal_dropped = (0, 0)
        """(version, groups) dynamic sampling has dropped for that version's batch: kept across a
        retried admission, so that its limit holds for the step."""
        self._warned_without_signal = False
        self.poll_seconds = 0.0
        """The part of it spent sleeping between looks, with no batch ready (the rest is
        listing, reading and validating shards: bookkeeping)."""
        self.resumed_over: tuple[int, frozenset[str]] = (0, frozenset())
        """(version, shard keys): the version this trainer resumed at and the shards committed
        before it did, which hold no row newer than that version (`_read_shards`)."""

    @property
    def version(self) -> int:
        return self.trainer.version

    def resume(self) -> int | None:
        """Restore the newest checkpoint (weights, optimizer, RNGs, ledger); its step, or None."""
        step = latest_checkpoint_step(self.store)
        if step is None:
            if any(json.loads(line)["event"] == "train_step" for line in self.metrics.lines):
                # A trainer that died before its first checkpoint: its steps' weights are withdrawn
                # (tasks/lag.py `reopen_run`), and its records with them (tasks/report.py).
                self.metrics.log("resumed", version=0, disposed=0)
                self.resumed_over = (0, frozenset(list_shards(self.store)))
            return None
        self.trainer = Trainer(self.trainer.model, self.config.training, version=step, ref_model=self.ref_model,
                               sampling_temperature=self.config.generation.temperature)  # fmt: skip
        try:
            state = load_checkpoint(self.store, self.trainer.model, self.trainer.optimizer, self.cache_dir / "checkpoints", step)
        except ManifestError as err:
            # Not resumed from an older one here: the pipeline withdrew the snapshots after this
            # step only (tasks/lag.py `reopen_run`); started again, it withdraws those after the older one.
            prefix = set_aside_checkpoint(self.store, step, str(err))
            older = latest_checkpoint_step(self.store)
            raise CheckpointDamaged(
                f"the checkpoint at step {step} failed verification ({err}): set aside ({self.store.url_of(prefix)}); "
                f"start the run again to resume from {f'step {older}' if older is not None else 'v0'}"
            ) from err
        self.ledger = Ledger.from_json(state.extra["ledger"])
        self.trainer.skipped_in_a_row = state.extra.get("skipped_in_a_row", 0)  # a checkpoint of an earlier release has none
        self._count_quarantined()  # moved after the checkpoint: never listed again
        # Shared at once: an admission shares only the losses it counts itself, and these (a group
        # set aside while the dead trainer no longer looked) held capacity the batch needs, for good
        # at max_lag 0.
        publish_trainer_state(self.store, TrainerState(step, self.ledger.lost_groups))
        # One directory below the window: the admit that would have given it its last look comes
        # after this checkpoint, and a group committed there after the dead trainer's own look
        # was checked by its generator against a state before this step.
        self.window_floor = max(0, step - self.config.lag.max_lag - 1)
        self.resumed_over = (step, frozenset(list_shards(self.store, min_version=self.window_floor)))
        self.metrics.log("resumed", version=step, disposed=len(self.ledger.disposed))
        if step not in snapshot_versions(self.store):
            # Retired, or skipped by publish_every: LATEST, moved back to the newest snapshot up to
            # this step (tasks/lag.py `reopen_run`), may name one too old to generate what it needs.
            publish_snapshot(self.store, self.trainer.model, self.tokenizer, step, dtype=self.publish_dtype)
        return step

    def admit_batch(self, should_stop: Callable[[], bool] = lambda: False, poll_seconds: float = 0.2) -> dict[str, pa.Table] | None:
        """The next batch's shards (key -> table), waiting until enough are there; None if told to stop."""
        groups, max_lag = self.config.training.prompts_per_step, self.config.lag.max_lag
        chosen: dict[str, pa.Table] = {}
        seen_groups = set(self.ledger.trained_groups) | set(self.ledger.dropped_groups)
        started = time.monotonic()
        self.poll_seconds = 0.0
        shared_losses = self.ledger.lost_groups
        late_checked = -LATE_CHECK_SECONDS
        while len(chosen) < groups:
            if should_stop():
                return None
            if time.monotonic() - late_checked >= LATE_CHECK_SECONDS:
                self._drop_late(seen_groups)
                self._count_quarantined()
                self._repair_rejected_snapshots(waited=time.monotonic() - started)
                late_checked = time.monotonic()
            if self.ledger.lost_groups != shared_losses:
                # Generators may replace a lost group as soon as they know of it: at max_lag 0 the
                # batch being filled needs its replacement, which they could not claim otherwise.
                shared_losses = self.ledger.lost_groups
                publish_trainer_state(self.store, TrainerState(self.version, shared_losses))
            batch, stale = select_batch(self._candidates(exclude=chosen), self.version, max_lag, groups - len(chosen))
            self._drop_stale([c.key for c in stale], seen_groups)
            # Only now: had the drop failed (storage down), the retried admission must list the
            # directory leaving the window again, or its stale groups were never counted lost.
            self.window_floor = max(self.window_floor, self.version - max_lag)
            if batch and waits_for_last_chance(batch, self.version, max_lag, lambda: groups_in_flight(self.store)):
                batch = []
            if not batch:
                if self.ledger.lost_groups == shared_losses:  # else share the losses first
                    time.sleep(poll_seconds)
                    self.poll_seconds += poll_seconds
                continue
            valid = self._read_shards([c.key for c in batch])
            for key, reason in valid.quarantined.items():
                self._dispose(key, "quarantined", samples=1)
            for key, table in valid.tables.items():
                group = table["group_id"][0].as_py()
                if group in seen_groups:  # a copy of a group trained or dropped before, or already in this batch
                    self._dispose(key, "duplicate", samples=table.num_rows)
                elif self._drops_without_signal(table):
                    seen_groups.add(group)
                    self.ledger.dropped_groups.append(group)
                    self._dispose(key, "no_signal", samples=table.num_rows)
                else:
                    seen_groups.add(group)
                    chosen[key] = table
        self.wait_seconds = time.monotonic() - started
        self.idle_seconds += self.wait_seconds
        return chosen

    def train_step(self, shards: dict[str, pa.Table], before_publish: Callable[[], None] = lambda: None) -> dict:
        """One RL step on `shards`; then publish, share the trainer state, checkpoint.

        Called again with the same shards after its publish or checkpoint failed (the training
        flow retries the task once after a storage outage longer than storage.retry_seconds), it
        finishes the step it applied instead of stepping again: a second optimizer step on one
        batch would count its groups twice and could train a last-chance group past max_lag.
        `before_publish` runs between the step and its first write, and raises to write nothing
        (the training flow's check that its pipeline still holds the run)."""
        started = time.monotonic()
        if self._unfinished is None:
            self._unfinished = (set(shards), self._apply_step(shards, started))
        elif self._unfinished[0] != set(shards):
            raise RuntimeError(f"v{self.version} is applied but not published: finish it before training other shards")
        step = self._unfinished[1]
        before_publish()
        published = time.monotonic()
        self._publish()
        publish_seconds = time.monotonic() - published
        step_seconds = time.monotonic() - step["started"]
        self.busy_seconds += time.monotonic() - started
        record = step["metrics"] | {
            "version": self.version, "tokens_per_second": step["metrics"]["tokens"] / step_seconds,
            "busy_seconds": self.busy_seconds, "idle_seconds": self.idle_seconds, "step_seconds": step_seconds,
            "wait_seconds": self.wait_seconds, "poll_seconds": self.poll_seconds, "compute_seconds": step["compute_seconds"],
            "publish_seconds": publish_seconds, **self.ledger.counts,
        }  # fmt: skip
        logged = self.metrics.log("train_step", **record)
        if self.version % self.config.training.checkpoint_every == 0:
            # Metrics first: a trainer resumed from this checkpoint must find every step's record
            # up to it, and metrics otherwise reach storage only every few seconds.
            self.metrics.flush()
            self._timed_checkpoint()
        self._unfinished = None
        return logged

    def _apply_step(self, shards: dict[str, pa.Table], started: float) -> dict:
        """The optimizer step on `shards` and their entries in the ledger: V becomes V+1."""
        table = pa.concat_tables(shards.values())
        rollouts = table_to_rollouts(table)
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        advantages = group_advantages(rewards, [r.group_id for r in rollouts])
        trained_at = self.version
        step_metrics = self.trainer.rl_step(build_batch(rollouts, advantages))
        simulated = self.config.training.simulate_step_seconds
        if simulated is not None:  # the benchmark's stand-in for a GPU step: the real tiny step is inside it
            time.sleep(max(0.0, simulated - (time.monotonic() - started)))
        compute_seconds = time.monotonic() - started
        lags = Counter()
        for key, shard in shards.items():
            self._dispose(key, "trained", samples=shard.num_rows)
            self.ledger.trained_groups.append(shard["group_id"][0].as_py())
            self.ledger.lags.append(lag_of(trained_at, parse_shard_key(key).version))  # its oldest row's
            lags.update(lag_of(trained_at, version) for version in shard["policy_version"].to_pylist())
        metrics = step_metrics | {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)), "samples": len(rollouts),
            "groups_without_signal": sum(map(without_signal, shards.values())),
            "lag_histogram": {str(k): lags[k] for k in sorted(lags)},
        }  # fmt: skip
        return {"metrics": metrics, "compute_seconds": compute_seconds, "started": started}

    def finish(self) -> bool:
        """The final weights' snapshot, the final checkpoint, the ledger for the run's accounting,
        and the trainer state marked done (generators stop on it); returns whether it published
        the snapshot. It does when publish_every skipped the last version: otherwise LATEST, the
        closing evaluation, the summary and a promotion would all name an older version than the
        one trained."""
        published = self.version % self.config.training.publish_every != 0
        if published:
            publish_snapshot(self.store, self.trainer.model, self.tokenizer, self.version, dtype=self.publish_dtype)
            apply_retention(self.store, self.config.storage.keep_last_snapshots, self.config.storage.keep_every_snapshot)
        if latest_checkpoint_step(self.store) != self.version:  # saved by the last step: a large model's
            self._timed_checkpoint()                             # state was written to disk a second time
        self.store.write_atomic(LEDGER_KEY, json.dumps(self.ledger.to_json()).encode())
        publish_trainer_state(self.store, TrainerState(self.version, self.ledger.lost_groups, done=True))
        self.metrics.flush()
        return published

    # -- internals ---------------------------------------------------------------------------

    def _candidates(self, exclude: dict[str, pa.Table]) -> list[Candidate]:
        """Committed, undisposed shards from the oldest version directory still worth a look on
        (`window_floor`, raised once this look's stale shards are disposed of): with those of
        versions ahead of the trainer's, which only a withdrawn snapshot generated."""
        keys = list_shards(self.store, min_version=self.window_floor)
        return [
            Candidate(key, parse_shard_key(key).version)
            for key in keys
            if key not in self.ledger.disposed and key not in exclude
        ]

    def _read_shards(self, keys: list[str]) -> ValidShards:
        """The shards of `keys`, read and validated, the bad ones quarantined. A row may not be
        newer than the trainer; in a shard committed before this trainer resumed, not newer than
        the version it resumed at: such a row was played on a snapshot the restart withdrew
        (tasks/lag.py `reopen_run`). A shard of rows of the resumed version and of a withdrawn
        one is keyed at the resumed version (its lowest), so nothing else tells it apart once
        the trainer has published the withdrawn number again."""
        model = self.trainer.model.config
        found = read_valid_shards(self.store, keys, current_version=self.version, vocab_size=model.vocab_size,
                                  context_length=model.max_position_embeddings, max_rows=self.config.generation.samples_per_prompt)  # fmt: skip
        resumed, before = self.resumed_over
        for key in [k for k, table in found.tables.items() if k in before and pc.max(table["policy_version"]).as_py() > resumed]:
            newest = pc.max(found.tables.pop(key)["policy_version"]).as_py()
            reason = (f"policy_version {newest} is past v{resumed}, the version this trainer resumed at, and the shard was committed "
                      "before it resumed: played on a snapshot the restart withdrew")  # fmt: skip
            log.warning("quarantined shard %s to %s: %s", key, quarantine_shard(self.store, key, self.store.read_bytes(key), reason), reason)
            found.quarantined[key] = reason
        return found

    def _drops_without_signal(self, table: pa.Table) -> bool:
        """Whether dynamic sampling drops this group: its rewards are all one, and this step has
        dropped fewer than training.dynamic_sampling_max_drops, and the shard keys can number the
        replacement (admission's slots end at MAX_SLOTS)."""
        training = self.config.training
        if not training.dynamic_sampling or not without_signal(table):
            return False
        version, dropped = self._without_signal_dropped
        dropped = dropped if version == self.version else 0
        slots_needed = (training.steps + self.config.lag.max_lag + 1) * training.prompts_per_step + self.ledger.lost_groups + 1
        if dropped < training.dynamic_sampling_max_drops and slots_needed <= MAX_SLOTS:
            self._without_signal_dropped = (self.version, dropped + 1)
            return True
        if not self._warned_without_signal:
            self._warned_without_signal = True
            why = (f"dropped {dropped} groups without signal (training.dynamic_sampling_max_drops): the policy solves or "
                   "fails most prompts" if dropped >= training.dynamic_sampling_max_drops
                   else f"the run's groups would number past {MAX_SLOTS:,} (lost {self.ledger.lost_groups})")  # fmt: skip
            print(f"dynamic sampling: the admission for v{self.version + 1} {why}; it trains on groups without signal, "
                  "which give no gradient (train_step's groups_without_signal counts them)")  # fmt: skip
        return False

    def _drop_late(self, accounted: set[str]) -> None:
        """Drop the groups that generators reported as committed past the lag bound, which the
        window's listings may have missed (tasks/lag.py "Late groups"), unless already disposed."""
        max_lag = self.config.lag.max_lag
        late = [key for key in late_shard_keys(self.store)
                if key not in self.ledger.disposed and lag_of(self.version, parse_shard_key(key).version) > max_lag]  # fmt: skip
        self._drop_stale(late, accounted)

    def _count_quarantined(self) -> None:
        """Count lost the groups in quarantine/ that this trainer has not disposed of: those a
        generator set aside as failed (tasks/failed_groups.py, no samples),
        and the shards a dead trainer quarantined after its last checkpoint. Lost, they are owed a
        replacement: the capacity they held would otherwise stall the run (at max_lag 0, one group
        short). One listing each, at each admission and every LATE_CHECK_SECONDS of its wait."""
        for key in sorted(set(failed_group_slots(self.store).values()) - set(self.ledger.disposed)):
            self._dispose(key, "quarantined", samples=0)
        for key in sorted(quarantined_keys(self.store) - set(self.ledger.disposed)):
            self._dispose(key, "quarantined", samples=1)

    def _repair_rejected_snapshots(self, waited: float) -> None:
        """Answer the generators' reports of a snapshot damaged after its commit
        (tasks/snapshots.py). Without an answer the generators kept their older weights, and
        where the bound needs the newest (at max_lag 0, every batch does) the run waited for good.

        Only a report of the newest snapshot's current commit counts (an older version is
        superseded, a newer commit answers it already), once this admission has `waited`
        `REPAIR_AFTER_WAIT_SECONDS`: a trainer that gets its batches needs no answer. And only
        once the trainer has checked the stored snapshot itself (a whole read: once a commit):
        one that verifies is a generator's own trouble (its disk, its network), and committing it
        again would only break the others' fetches. A damaged one is committed again if the
        trainer is still at its version, else the trainer publishes its own version now; at most
        `MAX_RECOMMITS` times a version. LATEST naming a snapshot with no manifest is a re-commit
        that failed half-way (storage down): it is made again. A report is deleted once answered,
        and only if no generator rewrote it meanwhile."""
        for key, report in rejection_reports(self.store).items():
            if report is not None and report["version"] == latest_version(self.store):
                if waited < REPAIR_AFTER_WAIT_SECONDS:
                    continue
                rejected, current = report["version"], manifest_digest(self.store, report["version"])
                if current is None or (current == report.get("manifest") and not self._snapshot_verifies(rejected, current)):
                    self._replace_snapshot(rejected, report)
            try:
                if read_rejection_report(self.store, key) == report:  # not rewritten meanwhile
                    self.store.delete(key)
            except FileNotFoundError:
                pass

    def _snapshot_verifies(self, version: int, digest: str) -> bool:
        if digest in self.verified_snapshots:
            return True
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="verify-", dir=self.cache_dir) as temp:
            try:
                load_snapshot(self.store, Path(temp) / "snapshot", version)
            except ManifestError:
                return False
        print(f"snapshot v{version}, reported damaged by a generator, verifies here: the trouble is that generator's")
        self.verified_snapshots.add(digest)
        return True

    def _replace_snapshot(self, rejected: int, report: dict) -> None:
        self.recommits[rejected] += 1
        if self.recommits[rejected] > MAX_RECOMMITS:
            print(f"snapshot v{rejected} was found damaged again after {MAX_RECOMMITS} new commits: not committed again; "
                  "is the storage corrupting what it stores?")  # fmt: skip
            return
        if self.version == rejected:
            recommit_snapshot(self.store, self.trainer.model, self.tokenizer, rejected, report.get("manifest"), self.publish_dtype)
        else:
            publish_snapshot(self.store, self.trainer.model, self.tokenizer, self.version, dtype=self.publish_dtype)
        print(f"snapshot v{rejected} was found damaged ({str(report.get('reason'))[:200]}); "
              f"published v{self.version} {'again' if self.version == rejected else 'in its place'}")  # fmt: skip
        self.metrics.log("snapshot_republished", rejected=rejected, version=self.version, reason=str(report.get("reason"))[:500])

    def _drop_stale(self, keys: list[str], accounted: set[str]) -> None:
        """Dispose of shards past the lag bound: as stale, or as a duplicate if their group is in
        `accounted` (the admission's groups: trained, dropped, or chosen for the batch being
        filled) from another copy, for which no replacement is owed, or one is already: counted lost,
        a stale copy of a group chosen already owed a replacement for a group that is trained.
        Adds the groups it drops to `accounted`."""
        valid = read_valid_shards(self.store, keys, current_version=self.version, max_rows=self.config.generation.samples_per_prompt)
        for key in valid.quarantined:
            self._dispose(key, "quarantined", samples=1)
        for key, table in valid.tables.items():
            group = table["group_id"][0].as_py()
            if group in accounted:
                self._dispose(key, "duplicate", samples=table.num_rows)
            else:
                accounted.add(group)
                self.ledger.dropped_groups.append(group)
                self._dispose(key, "stale", samples=table.num_rows)

    def _dispose(self, key: str, fate: str, samples: int) -> None:
        self.ledger.disposed[key] = fate
        self.ledger.count(fate, samples)
        if fate in LOST_FATES:
            self.metrics.log("dropped", key=key, fate=fate, version=self.version)

    def _publish(self) -> None:
        training = self.config.training
        if self.version % training.publish_every == 0:
            publish_snapshot(self.store, self.trainer.model, self.tokenizer, self.version, dtype=self.publish_dtype)
            apply_retention(self.store, self.config.storage.keep_last_snapshots, self.config.storage.keep_every_snapshot)
        publish_trainer_state(self.store, TrainerState(self.version, self.ledger.lost_groups))

    def _timed_checkpoint(self) -> None:
        """`_checkpoint`, its seconds recorded ("checkpoint") and counted busy: a save (model and
        optimizer, minutes for a large model) is the trainer's time as much as its steps."""
        saving = time.monotonic()
        self._checkpoint()
        seconds = time.monotonic() - saving
        self.busy_seconds += seconds
        self.metrics.log("checkpoint", version=self.version, seconds=seconds)

    def _checkpoint(self) -> None:
        save_checkpoint(self.store, self.version, self.trainer.model, self.trainer.optimizer,
                        ledger=sorted(self.ledger.disposed),
                        extra={"ledger": self.ledger.to_json(), "skipped_in_a_row": self.trainer.skipped_in_a_row})  # fmt: skip
        apply_checkpoint_retention(self.store, self.config.storage.keep_last_checkpoints)
        for key in late_shard_keys(self.store):
            if key in self.ledger.disposed:  # recorded in the checkpoint: a resumed trainer knows its fate
                forget_late(self.store, key)
