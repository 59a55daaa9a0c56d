"""Free ports on loopback, for servers tandem starts (SeaweedFS, engines) and for tests."""

from __future__ import annotations

import os
import random
import socket


_after_last_block: int | None = None
"""Where this process's next search starts: past the block it returned last."""

_handed_out: set[int] = set()
"""Every port this process was given: the server it was for may not have bound it yet (SeaweedFS
binds its admin port a while after it answers S3), so a bind test alone would hand it out again."""


def free_port_block(count: int = 1, start: int = 20000, end: int = 32000) -> int:
    """The first port P in [start, end) such that P..P+count-1 are all free on 127.0.0.1.

    Below 32000, Linux's default range for outgoing connections' ports, so that a port found
    free is not taken a moment later by some client's connection. A process's first search
    starts at a point drawn from its pid, so that processes looking at once rarely pick the same
    block (drawn, not a multiple of it: processes started together, such as pytest workers, have
    consecutive pids), and each later one past its last block, going round to `start` at the end
    (drawing again there gave the first block a second time)."""
    global _after_last_block
    seed = _after_last_block
    if seed is None:
        seed = start + random.Random(os.getpid()).randrange(end - start - count)
    seed = min(max(seed, start), end - count)
    for base in list(range(seed, end - count + 1, count)) + list(range(start, seed, count)):
        block = range(base, base + count)
        if _handed_out.isdisjoint(block) and all(port_is_free(port) for port in block):
            _after_last_block = base + count
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no block of {count} free ports between {start} and {end}")


def reserve_ports(ports: list[int]) -> None:
    """Never hand `ports` out in this process: fixed ports of servers that bind them later."""
    _handed_out.update(ports)


def port_is_free(port: int) -> bool:
    """Whether a server could listen on `port` of 127.0.0.1 now (one listening on any address could not)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
