"""Run an engine's command, and stop its process group once the process that started it dies.

    python -m infra.engines.guard PARENT_PID -- COMMAND...

Why: engines run in sessions of their own, so that stopping one stops its whole process group
(SGLang's scheduler and detokenizer processes included). The other side of that: a generation
process that is SIGKILLed (the OOM killer, a cancellation that escalates) leaves them running,
with a GPU's memory taken, and the restarted generation run on that machine then fails to start
its own. tandem's CPU engine watches its parent itself (`--parent-pid`); SGLang's server is not
ours to change, so `EngineProcess` runs it under this guard, which leads the group, polls its own
parent, and on its death SIGTERMs the group, waits up to `GRACE_SECONDS` for the command, then
SIGKILLs the group, itself included, so that none of the engine's own children outlive it. A
SIGTERM sent to the group (the usual stop) reaches the command too: the guard waits for it to exit
and exits with its code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_SECONDS = 1.0
GRACE_SECONDS = 20.0
"""How long the engine gets to exit after the SIGTERM, as `EngineProcess.stop` gives it."""


def guard(parent_pid: int, command: list[str]) -> int:
    """Run `command` until it exits, or until `parent_pid` is no longer this process's parent."""
    child = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM reached the command too: wait for it
    while child.poll() is None:
        if os.getppid() != parent_pid:
            print(f"guard: process {parent_pid} that started this engine is gone; stopping it", file=sys.stderr, flush=True)
            os.killpg(0, signal.SIGTERM)
            try:
                child.wait(GRACE_SECONDS)
            finally:
                os.killpg(0, signal.SIGKILL)  # what the engine's own children left, and this guard
        try:
            child.wait(POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    return child.returncode


def guarded(command: list[str]) -> list[str]:
    """`command` run under the guard, with this process as the parent it watches."""
    return [sys.executable, "-m", "infra.engines.guard", str(os.getpid()), "--", *command]


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: python -m infra.engines.guard PARENT_PID -- COMMAND...")
    code = guard(int(sys.argv[1]), sys.argv[3:])
    sys.exit(code if code >= 0 else 128 - code)
