"""The store a job hosts for one machine listens on the loopback address only: the kernel's own record of the
listening socket says 127.0.0.1, and a connection to the machine's other addresses on that port is refused."""

import datetime
import errno
import socket

import psutil
import pytest


def _listening(port: int) -> list[str]:
    """The local addresses of this process's listening TCP sockets on `port` (the kernel's view, via psutil)."""
    return sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == port})


def _other_addresses() -> list[tuple[int, str]]:
    """(family, address) of this machine's non-loopback, non-link-local interface addresses."""
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                found.append((a.family, a.address))
            elif a.family == socket.AF_INET6 and a.address != "::1" and not a.address.lower().startswith("fe80"):
                found.append((a.family, a.address.split("%")[0]))
    return found


def _connect(family: int, address: str, port: int) -> int:
    """0 if a TCP connection to address:port is accepted, else the errno."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        return s.connect_ex((address, port))


def _assert_loopback_only(port: int) -> None:
    assert _listening(port) == ["127.0.0.1"]
    others = _other_addresses()
    if not others:
        pytest.skip("this machine has no non-loopback address to try the store's port on")
    for family, address in others:
        assert _connect(family, address, port) == errno.ECONNREFUSED, (address, port)
    assert _connect(socket.AF_INET, "127.0.0.1", port) == 0


def test_a_plain_tcpstore_listens_everywhere_so_the_check_can_fail():
    """The reference the next tests are measured against: torch's `TCPStore("127.0.0.1", ...)` listens on every
    interface and is reachable at the machine's other addresses."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _listening(store.port) in (["::"], ["0.0.0.0"])
    others = _other_addresses()
    if not others:
        pytest.skip("this machine has no non-loopback address to try the store's port on")
    assert _connect(*others[0], store.port) == 0


def test_the_single_process_jobs_store_listens_on_loopback_only_and_serves_its_children():
    import torch.distributed as dist

    from hfllamarl.runtime.world.topology import Topology

    topo = Topology(mode="single", rank=0, world_size=2, num_generators=1, timeout_s=5, use_cpu=True)
    store = topo.store()
    host, port = topo.store_addr
    assert (host, port) == ("127.0.0.1", store.port)
    _assert_loopback_only(port)
    client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    client.set("from-a-child", "1")  # what a generator child does through the same address
    assert store.get("from-a-child") == b"1"


def test_a_launcher_rank_hosting_the_store_at_a_loopback_rendezvous_listens_there_only(monkeypatch):
    """A launcher whose rank 0 hosts the store (no agent store) at MASTER_ADDR=127.0.0.1: same guarantee."""
    from hfllamarl.runtime.world.topology import Topology

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with socket.socket() as s:  # a free port to name as MASTER_PORT
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    topo = Topology(mode="launcher", rank=0, world_size=2, num_generators=1, timeout_s=5, use_cpu=True,
                    store_addr=("127.0.0.1", port))
    topo.store()
    assert topo.hosts_store
    _assert_loopback_only(port)


def test_a_busy_port_is_refused_with_what_to_do():
    from hfllamarl.runtime.world.topology import TopologyError, host_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(TopologyError, match="MASTER_PORT"):
            host_store("127.0.0.1", s.getsockname()[1], datetime.timedelta(seconds=5))
