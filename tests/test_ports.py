"""Free port blocks (infra/ports.py): a process that starts several servers gets blocks that do
not overlap, though none of them is bound yet when it asks for the next."""

from __future__ import annotations

from infra.ports import free_port_block, reserve_ports


def test_blocks_asked_in_turn_do_not_overlap_before_their_servers_bind():
    """benchmarks/faults.py started SeaweedFS on P..P+8, then asked a port for the Prefect server
    before SeaweedFS had bound P+8 (its admin port), got P+8, and the server failed to start. Two
    SeaweedFS servers of one process (a test's own beside the session's) met the same way."""
    blocks = [(free_port_block(9), 9), (free_port_block(9), 9), (free_port_block(1), 1), (free_port_block(2), 2)]
    ports = [port for base, count in blocks for port in range(base, base + count)]
    assert len(ports) == len(set(ports)) == 21


def test_a_search_that_reaches_the_end_goes_round_without_giving_a_block_twice():
    """The search after a block near `end` started over at the pid's draw, which gave the first
    block again (CI: two blocks of 9 at 31987). It goes round to `start` now, and a port handed
    out is never handed out again, bound or not."""
    start, end = 30400, 30430
    blocks = []
    for _ in range(10):
        try:
            blocks.append(free_port_block(9, start=start, end=end))
        except RuntimeError:
            break
    ports = [port for base in blocks for port in range(base, base + 9)]
    assert len(blocks) >= 2 and len(ports) == len(set(ports))
    assert all(start <= port < end for port in ports)


def test_ports_reserved_for_a_server_that_binds_later_are_never_handed_out():
    """A fixed engine.base_port range is bound by SGLang only once its model has loaded: the
    torch.distributed ports drawn for the fleet must not land there meanwhile."""
    start, end = 30500, 30520
    reserve_ports(list(range(start, start + 10)))
    first = free_port_block(5, start=start, end=end)
    assert first >= start + 10, "a reserved port was handed out"
