"""Free ports on loopback, for servers tandem starts (SeaweedFS, engines) and for tests."""

from __future__ import annotations

import os
import random
import socket


_after_last_block: int | None = None
"""Where this process's next search starts: past the block it returned last, which the server it
was for may not have bound yet (SeaweedFS binds its admin port a while after it answers S3)."""


def free_port_block(count: int = 1, start: int = 20000, end: int = 32000) -> int:
    """The first port P in [start, end) such that P..P+count-1 are all free on 127.0.0.1.

    Below 32000, Linux's default range for outgoing connections' ports, so that a port found
    free is not taken a moment later by some client's connection. A process's first search
    starts at a point drawn from its pid, so that processes looking at once rarely pick the same
    block (drawn, not a multiple of it: processes started together, such as pytest workers, have
    consecutive pids), and each later one past its last block."""
    global _after_last_block
    seed = _after_last_block
    if seed is None or not start <= seed < end - count:
        seed = start + random.Random(os.getpid()).randrange(end - start - count)
    for base in list(range(seed, end - count, count)) + list(range(start, seed, count)):
        if all(_port_is_free(port) for port in range(base, base + count)):
            _after_last_block = base + count
            return base
    raise RuntimeError(f"no block of {count} free ports between {start} and {end}")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
