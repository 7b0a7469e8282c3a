"""`ckptstore.testing.servers.free_port`: pytest-xdist workers never share a port."""

from __future__ import annotations

import socket

import pytest

from ckptstore.testing import servers


def test_each_xdist_worker_draws_from_its_own_block_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    blocks = []
    for worker in (0, 1, 7):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        low = servers.PORT_BLOCKS_START + worker * servers.PORT_BLOCK
        ports = {servers.free_port() for _ in range(20)}
        assert all(low <= p < low + servers.PORT_BLOCK for p in ports)
        assert len(ports) > 1  # drawn at random, not the block's first port each time
        blocks.append(ports)
    assert max(max(b) for b in blocks) < ephemeral_low
    assert not blocks[0] & blocks[1]


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # A block of three ports far above the real workers' blocks (which this run may use).
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw6000")
    monkeypatch.setattr(servers, "PORT_BLOCK", 3)
    monkeypatch.setattr(servers, "PORT_BLOCKS", 10_000)
    low = servers.PORT_BLOCKS_START + 6000 * 3
    held = []
    try:
        for port in (low, low + 1):
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held.append(sock)
        assert {servers.free_port() for _ in range(10)} == {low + 2}
        sock = socket.socket()
        sock.bind(("127.0.0.1", low + 2))
        sock.listen()
        held.append(sock)
        with pytest.raises(RuntimeError, match="no free port"):
            servers.free_port()
    finally:
        for sock in held:
            sock.close()


def test_outside_xdist_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    port = servers.free_port()
    assert port >= 1024
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free, as promised
