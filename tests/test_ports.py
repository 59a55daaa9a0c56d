"""Free port blocks (infra/ports.py): a process that starts several servers gets blocks that do
not overlap, though none of them is bound yet when it asks for the next."""

from __future__ import annotations

from infra.ports import free_port_block


def test_blocks_asked_in_turn_do_not_overlap_before_their_servers_bind():
    """benchmarks/faults.py started SeaweedFS on P..P+8, then asked a port for the Prefect server
    before SeaweedFS had bound P+8 (its admin port), got P+8, and the server failed to start. Two
    SeaweedFS servers of one process (a test's own beside the session's) met the same way."""
    blocks = [(free_port_block(9), 9), (free_port_block(9), 9), (free_port_block(1), 1), (free_port_block(2), 2)]
    ports = [port for base, count in blocks for port in range(base, base + count)]
    assert len(ports) == len(set(ports)) == 21
