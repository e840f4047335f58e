"""``free_port``: ports that an outgoing connection cannot take before the server binds them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from testkit import local_server
from testkit.local_server import free_port


def _ephemeral() -> tuple[int, int]:
    low, high = local_server.EPHEMERAL_RANGE.read_text().split()
    return int(low), int(high)


@pytest.mark.skipif(not local_server.EPHEMERAL_RANGE.exists(), reason="Linux /proc only")
def test_ports_are_below_the_ephemeral_range_bindable_and_never_handed_out_twice() -> None:
    low, _ = _ephemeral()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(low - local_server.BELOW_EPHEMERAL <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


@pytest.mark.skipif(not local_server.EPHEMERAL_RANGE.exists(), reason="Linux /proc only")
def test_client_connections_take_ports_from_the_range_free_port_avoids() -> None:
    """The failure this prevents: a client's connection took a port picked by bind(0)."""
    low, high = _ephemeral()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        clients = [socket.create_connection(listener.getsockname()) for _ in range(20)]
        try:
            taken = {c.getsockname()[1] for c in clients}
            assert all(low <= p <= high for p in taken), "connections take ephemeral ports"
            ports = {free_port() for _ in range(20)}
            assert not taken & ports
            assert not any(low <= p <= high for p in ports), "none a connection could take"
        finally:
            for c in clients:
                c.close()


def test_a_port_someone_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        draws = iter([busy, busy])
        real = local_server._pick.randrange
        monkeypatch.setattr(local_server, "_ephemeral_low", lambda: 60_000)
        monkeypatch.setattr(
            local_server._pick, "randrange", lambda a, b: next(draws, None) or real(a, b)
        )
        assert free_port() != busy
        assert next(draws, None) is None, "the busy port was drawn and refused"


def test_without_the_kernel_s_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = local_server.EPHEMERAL_RANGE
    monkeypatch.setattr(local_server, "EPHEMERAL_RANGE", tmp_path / "absent")
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    if real.exists():
        low, high = (int(v) for v in real.read_text().split())
        assert low <= port <= high, "bind(0)'s port: the kernel's ephemeral range"
