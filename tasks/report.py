"""The end of a run: the accounting identity, the summary, and the plots, from the run directory.

Everything here is read back from storage, not taken from the processes' memory, so the same
report can be made for any run, finished or killed, local or deployed:

    generated = trained + dropped_stale + dropped_no_signal + quarantined + duplicate + pending   (samples)

`generated` comes from the generators' own records of the shards they committed, the trained,
dropped and duplicate counts from the learner's ledger (rows it actually read), and `pending` from
listing the committed shards the ledger never disposed of. A shard lost between a generator and
the trainer would break the equality, which is why it is checked rather than derived.

A shard that no generator recorded (a copy of a shard under a second key, say) is foreign: it is
counted apart (`foreign_shards`) and its rows are taken out of the ledger's counts, since they
were never generated. The learner trains a group once whichever copy it reads first, and
disposes of the other as a duplicate. A group its environment failed (tasks/failed_groups.py)
holds no sample: it is counted apart (`groups_failed`).
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
from tasks.metrics import read_metrics  # noqa: E402
from tasks.shards import list_shards  # noqa: E402

SUMMARY_KEY = "summary.json"


def generator_records(store: RunStore) -> dict[str, dict]:
    """Shard key -> the generator's record of it, over every generator of the run."""
    records = {}
    for key in store.list("metrics"):
        name = key.rsplit("/", 1)[-1].removesuffix(".jsonl")
        if name.startswith("generator-"):
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
    """The trainer's step records, one per version: a trainer killed after a step and resumed
    from an earlier checkpoint trains that version again, and the later record is the one whose
    weights the run kept."""
    by_version = {r["version"]: r for r in read_metrics(store, "trainer") if r["event"] == "train_step"}
    return [by_version[v] for v in sorted(by_version)]


def write_summary(store: RunStore, eval_before: dict | None, eval_after: dict | None) -> dict:
    """summary.json and the plots; returns the summary. The held-out figures are None for a run
    without evaluation (`env.eval_prompts: 0`). Each figure says which versions it covers: for a
    continued run the evaluations score the continuation (its start and end), while the batch
    rewards span every step the run has trained."""
    steps = train_steps(store)
    head, tail = steps[: max(1, len(steps) // 10)], steps[-max(1, len(steps) // 10):]
    # Summed over the kept steps, not the last record's running totals: those start again at 0
    # in a resumed trainer, and would describe its life only.
    busy, idle = sum(r.get("step_seconds", 0.0) for r in steps), sum(r.get("wait_seconds", 0.0) for r in steps)
    summary = {
        "steps": len(steps),
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
    plot_timeline(store, steps, list(generator_records(store).values()))
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
        ("train steps", str(summary["steps"])),
        ("trainer idle fraction", f"{summary['trainer_idle_fraction']:.2f}"),
        ("samples", f"{summary['generated']} generated = {identity}: {'holds' if summary['identity_holds'] else 'BROKEN'}"),
        ("max trained lag", str(summary["max_trained_lag"])),
        *([("groups the environment failed", f"{summary['groups_failed']}, set aside in quarantine/ with their tracebacks")]
          if summary.get("groups_failed") else []),
    ]


def plot_reward(store: RunStore, steps: list[dict]) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["version"] for r in steps], [r["reward_mean"] for r in steps], marker=".")
    axis.set(xlabel="policy version (trainer step)", ylabel="mean reward of the trained batch", title="reward")
    axis.grid(alpha=0.3)
    _save(store, figure, "plots/reward.png")


def plot_timeline(store: RunStore, steps: list[dict], groups: list[dict]) -> None:
    """When the trainer stepped or waited for data, and when generation had groups in flight."""
    timed = [g for g in groups if "started_at" in g]
    if not steps and not timed:
        return
    origin = min([r["time"] - r["step_seconds"] - r["wait_seconds"] for r in steps] + [g["started_at"] for g in timed])
    train_busy = [(r["time"] - r["step_seconds"] - origin, r["step_seconds"]) for r in steps]
    train_wait = [(r["time"] - r["step_seconds"] - r["wait_seconds"] - origin, r["wait_seconds"]) for r in steps]
    generating = _union((g["started_at"] - origin, g["finished_at"] - origin) for g in timed)
    figure, axis = plt.subplots(figsize=(10, 2.6))
    axis.broken_barh(train_wait, (10, 8), color="#f2c14e", linewidth=0, label="trainer waiting for data")
    axis.broken_barh(train_busy, (10, 8), color="#2a6f97", linewidth=0, label="trainer stepping")
    axis.broken_barh([(a, b - a) for a, b in generating], (0, 8), color="#52a675", linewidth=0, label="groups in flight")
    axis.set(yticks=[4, 14], yticklabels=["generation", "training"], xlabel="seconds since the first step started", title="timeline")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, frameon=False)
    _save(store, figure, "plots/timeline.png")


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
