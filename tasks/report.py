"""The end of a run: the accounting identity, the summary, and the plots, from the run directory.

Everything here is read back from storage, not taken from the processes' memory, so the same
report is made for a local or a deployed run. It is made when the trainer has finished: the
learner's ledger is written whole then (lag/ledger.json; a killed trainer's stands in its newest
checkpoint, which its resumed successor goes on from).

    generated = trained + dropped_stale + dropped_no_signal + quarantined + duplicate + pending   (samples)

`generated` comes from the generators' own records of the shards they committed, the trained,
dropped and duplicate counts from the learner's ledger (rows it actually read), and `pending` from
listing the committed shards the ledger never disposed of. A shard lost between a generator and
the trainer would break the equality, which is why it is checked rather than derived.

A shard that no generator recorded is foreign: a copy of a shard under a second key, or a shard
of a generator killed before it flushed its records, which no restart under its name recovered
(the summary table shows the count and says so). It is counted apart (`foreign_shards`) and its
rows are taken out of the ledger's counts, so that the identity compares like with like. The
learner trains a group once whichever copy it reads first, and disposes of the other as a
duplicate. A group set aside as failed (tasks/failed_groups.py: its environment failed it, or
every try was aborted) holds no sample: it is counted apart (`groups_failed`).
"""

from __future__ import annotations

import io
import json
from collections import Counter

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from infra.storage import RunStore  # noqa: E402
from tasks.failed_groups import failed_group_slots  # noqa: E402
from tasks.ledger import COUNTS, LEDGER_KEY, Ledger  # noqa: E402
from tasks.metrics import generator_components, read_metrics  # noqa: E402
from tasks.shards import list_shards  # noqa: E402

SUMMARY_KEY = "summary.json"


def generator_records(store: RunStore) -> dict[str, dict]:
    """Shard key -> the generator's record of it, over every generator of the run."""
    records = {}
    for name in generator_components(store):
        records |= {r["key"]: r for r in read_metrics(store, name) if r["event"] == "group"}
    return records


def accounting(store: RunStore) -> dict:
    """The accounting identity of the run, checked; counts are samples."""
    generated = generator_records(store)
    try:
        ledger = Ledger.from_json(json.loads(store.read_bytes(LEDGER_KEY)))
    except FileNotFoundError:
        ledger = Ledger()
    pending_keys = [k for k in list_shards(store) if k not in ledger.disposed]
    quarantined = sum(generated.get(k, {}).get("samples", 0) for k, fate in ledger.disposed.items() if fate == "quarantined")
    failed = set(failed_group_slots(store).values())  # set aside with no sample: none to count
    foreign = [k for k in [*ledger.disposed, *pending_keys] if k not in generated and k not in failed]
    foreign_rows = Counter()
    for key in foreign:
        foreign_rows[ledger.disposed.get(key, "pending")] += _rows_of(store, key)
    counts = {
        "generated": sum(r["samples"] for r in generated.values()),
        "trained": ledger.counts["trained"] - foreign_rows["trained"],
        "dropped_stale": ledger.counts["dropped_stale"] - foreign_rows["stale"],
        "dropped_no_signal": ledger.counts["dropped_no_signal"] - foreign_rows["no_signal"],
        "quarantined": quarantined,
        "duplicate": ledger.counts["duplicate"] - foreign_rows["duplicate"],
        "pending": sum(generated.get(k, {}).get("samples", 0) for k in pending_keys),
    }
    accounted = sum(v for k, v in counts.items() if k != "generated")
    return counts | {"identity_holds": accounted == counts["generated"], "foreign_shards": len(foreign), "groups_failed": len(failed),
                     "max_trained_lag": max(ledger.lags, default=0)}  # fmt: skip


def _rows_of(store: RunStore, key: str) -> int:
    """Rows of a shard from its Parquet footer; 0 for one that does not parse (the ledger counts
    no rows for a quarantined shard either)."""
    try:
        return pq.read_metadata(io.BytesIO(store.read_bytes(key))).num_rows
    except (OSError, ValueError, pa.ArrowException):
        return 0


def train_steps(store: RunStore) -> list[dict]:
    """The trainer's step records of the weights the run kept (`kept_train_steps`)."""
    return kept_train_steps(read_metrics(store, "trainer"))


def checkpoint_saves(records: list[dict]) -> list[dict]:
    """The trainer's records of its checkpoint saves, one per version (a save a resumed trainer
    made again replaces its predecessor's), of the versions its step records keep."""
    kept = {step["version"] for step in kept_train_steps(records)}
    saves = {r["version"]: r for r in records if r["event"] == "checkpoint" and r["version"] in kept}
    return [saves[v] for v in sorted(saves)]


def kept_train_steps(records: list[dict]) -> list[dict]:
    """The train_step records among a trainer's `records` that describe the weights the run kept,
    one per version, in version order. A trainer resumed from its checkpoint at step K (its
    "resumed" record) trains K+1, ... again: its dead predecessor's records past K are of weights
    the run withdrew (tasks/lag.py `reopen_run`), and are dropped there, whether or not the run
    reaches those versions again (a continued run of fewer steps does not)."""
    by_version: dict[int, dict] = {}
    for record in records:
        if record["event"] == "train_step":
            by_version[record["version"]] = record
        elif record["event"] == "resumed":
            by_version = {version: step for version, step in by_version.items() if version <= record["version"]}
    return [by_version[v] for v in sorted(by_version)]


def write_summary(store: RunStore, eval_before: dict | None, eval_after: dict | None) -> dict:
    """summary.json and the plots; returns the summary. The held-out figures are None for a run
    without evaluation (`env.eval_prompts: 0`). Each figure says which versions it covers: for a
    continued run the evaluations score the continuation (its start and end), while the batch
    rewards span every step the run has trained."""
    records = read_metrics(store, "trainer")
    steps, saves = kept_train_steps(records), checkpoint_saves(records)
    head, tail = steps[: max(1, len(steps) // 10)], steps[-max(1, len(steps) // 10):]
    # Summed over the kept steps, not the last record's running totals: those start again at 0
    # in a resumed trainer, and would describe its life only.
    busy = sum(r.get("step_seconds", 0.0) for r in steps) + sum(r["seconds"] for r in saves)
    idle = sum(r.get("wait_seconds", 0.0) for r in steps)
    summary = {
        "steps": len(steps),
        "steps_skipped": sum(int(r.get("skipped", 0)) for r in steps),
        "reward_start": _mean(r["reward_mean"] for r in head),
        "reward_end": _mean(r["reward_mean"] for r in tail),
        "reward_versions": [_span(head), _span(tail)],
        "eval_before": None if eval_before is None else eval_before["score"],
        "eval_after": None if eval_after is None else eval_after["score"],
        "solved_before": None if eval_before is None else eval_before["solved"],
        "solved_after": None if eval_after is None else eval_after["solved"],
        "eval_versions": None if eval_before is None else [eval_before.get("version"), eval_after.get("version")],
        "trainer_idle_fraction": idle / (busy + idle) if busy + idle else 0.0,
        **accounting(store),
    }
    store.write_atomic(SUMMARY_KEY, json.dumps(summary, indent=2).encode())
    plot_reward(store, steps)
    since = max((r["time"] for r in records if r["event"] == "resumed"), default=None)
    plot_timeline(store, steps, saves, list(generator_records(store).values()), since)
    return summary


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The summary as (label, text) rows: what the console table and the UI artifact show."""
    identity = " + ".join(f"{summary.get(k, 0)} {k}" for k in (*COUNTS, "pending"))  # a summary written before a count was kept has none
    if summary["eval_before"] is None:
        score = solved = "not evaluated (env.eval_prompts is 0)"
    else:
        versions = " -> ".join(f"v{v}" for v in summary.get("eval_versions") or [] if v is not None)
        score = f"{summary['eval_before']:.3f} -> {summary['eval_after']:.3f}" + (f" ({versions})" if versions else "")
        solved = f"{summary['solved_before']:.1%} -> {summary['solved_after']:.1%}"
    reward = f"{summary['reward_start']:.3f} -> {summary['reward_end']:.3f}"
    if spans := [span for span in summary.get("reward_versions") or [] if span]:
        reward += " (" + " / ".join(f"v{a}-v{b}" if a != b else f"v{a}" for a, b in spans) + ")"
    return [
        ("held-out eval score", score),
        ("held-out solved", solved),
        ("batch reward (first / last 10% of steps)", reward),
        ("train steps", str(summary["steps"]) + (f", {skipped} of them skipped: a gradient that was not finite, no update"
                                                 if (skipped := summary.get("steps_skipped")) else "")),
        ("trainer idle fraction", f"{summary['trainer_idle_fraction']:.2f}"),
        ("samples", f"{summary['generated']} generated = {identity}: {'holds' if summary['identity_holds'] else 'BROKEN'}"),
        ("max trained lag", str(summary["max_trained_lag"])),
        *([("shards no generator recorded", f"{summary['foreign_shards']}, left out of the counts above: copies under a "
            "second key, or shards of a generator killed before it recorded them")] if summary.get("foreign_shards") else []),
        *([("groups failed", f"{summary['groups_failed']}, set aside in quarantine/failed-groups/ with their errors")]
          if summary.get("groups_failed") else []),
    ]


def plot_reward(store: RunStore, steps: list[dict]) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["version"] for r in steps], [r["reward_mean"] for r in steps], marker=".")
    axis.set(xlabel="policy version (trainer step)", ylabel="mean reward of the trained batch", title="reward")
    axis.grid(alpha=0.3)
    _save(store, figure, "plots/reward.png")


def plot_timeline(store: RunStore, steps: list[dict], saves: list[dict], groups: list[dict], since: float | None = None) -> None:
    """When the trainer stepped, saved a checkpoint or waited for data, and when generation had
    groups in flight (`timeline_bars`)."""
    bars = timeline_bars(steps, saves, groups, since)
    if bars is None:
        return
    figure, axis = plt.subplots(figsize=(10, 2.6))
    axis.broken_barh(bars["waiting"], (10, 8), color="#f2c14e", linewidth=0, label="trainer waiting for data")
    axis.broken_barh(bars["busy"], (10, 8), color="#2a6f97", linewidth=0, label="trainer stepping or saving a checkpoint")
    axis.broken_barh(bars["generating"], (0, 8), color="#52a675", linewidth=0, label="groups in flight")
    start = "the trainer's first wait for data or the first group" + (" after the trainer last resumed" if since is not None else "")
    axis.set(yticks=[4, 14], yticklabels=["generation", "training"], xlabel=f"seconds since {start}", title="timeline")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, frameon=False)
    _save(store, figure, "plots/timeline.png")


def timeline_bars(steps: list[dict], saves: list[dict], groups: list[dict], since: float | None) -> dict | None:
    """The timeline's (start, width) bars in seconds from its origin: "busy" and "waiting" for the
    trainer, "generating" for the union of the groups in flight; None with nothing to show. Of a
    resumed run, only what followed the last resumption (`since`): a continued run's sessions can
    lie days apart, and its seconds-long steps would not show. A group in flight as the trainer
    resumed (generators start beside it) shows from then on."""
    since = since if since is not None else -float("inf")
    steps = [r for r in steps if r["time"] - r["step_seconds"] - r["wait_seconds"] >= since]
    saves = [r for r in saves if r["time"] - r["seconds"] >= since]
    timed = [(max(g["started_at"], since), g["finished_at"]) for g in groups if "started_at" in g and g["finished_at"] >= since]
    if not steps and not timed:
        return None
    origin = min([r["time"] - r["step_seconds"] - r["wait_seconds"] for r in steps] + [start for start, _ in timed])
    busy = [(r["time"] - r["step_seconds"] - origin, r["step_seconds"]) for r in steps]
    busy += [(r["time"] - r["seconds"] - origin, r["seconds"]) for r in saves]
    waiting = [(r["time"] - r["step_seconds"] - r["wait_seconds"] - origin, r["wait_seconds"]) for r in steps]
    generating = [(a, b - a) for a, b in _union((start - origin, end - origin) for start, end in timed)]
    return {"busy": sorted(busy), "waiting": waiting, "generating": generating}


def _union(intervals) -> list[tuple[float, float]]:
    """Merge overlapping (start, end) intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _save(store: RunStore, figure, key: str) -> None:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    store.write_atomic(key, buffer.getvalue())


def _span(steps: list[dict]) -> list[int] | None:
    """The first and last version of a run of step records (a step record is the version it made)."""
    return [steps[0]["version"], steps[-1]["version"]] if steps else None


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
