"""Metrics: one JSON object a line in {run}/metrics/{component}.jsonl.

Each component (trainer, each generator, evaluation) owns its own file, so no two writers
touch one object. The exception is a deployed run's evaluations: the pipeline's closing one may
finish within the same milliseconds as a triggered one, and then one line is lost. Object
storage cannot append, so `MetricsLog` keeps the component's lines and rewrites the object
atomically, at most every `flush_seconds` (longer for a file of many MB: a second per MB) at a
record and on close: a reader always sees whole lines, and a crash loses the lines since the last
flush, never a run's data.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from infra.storage import RunStore, StorageRejected

METRICS = "metrics"
FLUSH_BYTES_PER_SECOND = 1_000_000
"""A metrics file over this size is rewritten at most this many bytes a second, averaged
(`MetricsLog.flush_interval`)."""


class MetricsLog:
    """Append-only metrics of one component, flushed to the run directory."""

    def __init__(self, store: RunStore, component: str, flush_seconds: float = 2.0):
        self.store = store
        self.key = f"{METRICS}/{component}.jsonl"
        self.flush_seconds = flush_seconds
        self.lines = self._existing_lines()
        self._bytes = sum(len(line) + 1 for line in self.lines)
        self._flushed_at = 0.0
        self._dirty = False

    def log(self, event: str, **fields: Any) -> dict:
        """Record one event (wall time added); returns the record."""
        record = {"event": event, "time": time.time(), **{k: _plain(v) for k, v in fields.items()}}
        line = json.dumps(record, allow_nan=False)
        self.lines.append(line)
        self._bytes += len(line) + 1
        self._dirty = True
        if time.monotonic() - self._flushed_at >= self.flush_interval():
            self.flush()
        return record

    def flush_interval(self) -> float:
        """`flush_seconds`, or a second per MB written so far if that is longer: every flush
        rewrites the whole file, and a long run's generator file (a line per group) reaches tens
        of MB, which every 2 s would be that many MB/s of writes for a few lines each time."""
        if self._bytes < FLUSH_BYTES_PER_SECOND:
            return self.flush_seconds  # 0 (tests, one-off records): every record
        return max(self.flush_seconds, self._bytes / FLUSH_BYTES_PER_SECOND)

    def flush(self) -> None:
        if self._dirty:
            self.store.write_atomic(self.key, ("\n".join(self.lines) + "\n").encode())
            self._dirty = False
        self._flushed_at = time.monotonic()

    def _existing_lines(self) -> list[str]:
        """A restarted component continues its file instead of overwriting its history."""
        try:
            return self.store.read_bytes(self.key).decode().splitlines()
        except FileNotFoundError:
            return []


def read_metrics(store: RunStore, component: str) -> list[dict]:
    """Every record of one component's metrics file ([] if it has none yet)."""
    try:
        data = store.read_bytes(f"{METRICS}/{component}.jsonl")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def generator_components(store: RunStore) -> list[str]:
    """The metrics components of the run's generators (`generator-gen0`, ...), from one listing."""
    names = (key.rsplit("/", 1)[-1].removesuffix(".jsonl") for key in store.list(METRICS))
    return [name for name in names if name.startswith("generator-")]


class MetricsTail:
    """One component's records, read as its file grows: each `records()` fetches only the bytes
    written since the one before. A long run's files reach tens of MB (a generator writes a line
    per group: 160,000 lines in 10,000 steps of 16 groups), and a reader that looks every second
    (the progress bars, the supervisor's autoscale) spent a core parsing them whole again.

    The writer rewrites the file with its old lines first (`MetricsLog`), so what was read stays
    a prefix. The read starts one byte early, at the newline that ended the last line taken: a
    file rewritten otherwise (shorter, or another component's history) does not show it there,
    and is read again whole."""

    def __init__(self, store: RunStore, component: str):
        self.store = store
        self.key = f"{METRICS}/{component}.jsonl"
        self.offset = 0
        """Bytes of the file read and parsed: whole lines only."""
        self.taken: list[dict] = []

    def records(self) -> list[dict]:
        """Every record of the file so far ([] while it has none)."""
        try:
            data = self.store.read_bytes(self.key, start=max(self.offset - 1, 0))
        except FileNotFoundError:
            data = b""
        except StorageRejected:
            if not self.offset:
                raise
            data = b""  # the range lies past the file's end: it was rewritten shorter
        if self.offset:
            if not data.startswith(b"\n"):
                self.offset, self.taken = 0, []
                return self.records()
            data = data[1:]
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written is taken next time
        self.taken += [json.loads(line) for line in whole.decode().splitlines() if line.strip()]
        self.offset += len(whole)
        return self.taken


def _plain(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None, numpy/torch scalars become Python numbers."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
