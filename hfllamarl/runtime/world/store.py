"""The job's store: a `TCPStore` that a single-process job hosts on the loopback address only."""

from __future__ import annotations

import datetime
import os


def _loopback(host: str) -> bool:
    """Whether `host` is a literal loopback address (127.0.0.0/8, ::1)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to an address other machines reach
        return False


def host_store(host: str, port: int, timeout: datetime.timedelta):
    """Host the job's `TCPStore` at `host:port` (port 0: any free port; read it from `.port`).

    The store has no authentication and the channels unpickle what crosses it, so a store meant for one machine
    must not be reachable from another. `TCPStore`'s host argument does not choose the address it listens on
    (its server listens on every interface, `::`), so for a loopback `host` this binds the listening socket
    itself, on that address only, and hands it over (`master_listen_fd`; the store then owns and closes it).
    That takes the libuv server (torch's default): with the older server a client connecting to a handed-over
    socket was seen to hang. Any other `host` (a multi-machine job's rendezvous address) is left to torch: every
    interface, as torchrun's own store listens.
    """
    import socket

    import torch.distributed as dist

    from hfllamarl.runtime.world.topology import TopologyError

    if not _loopback(host):
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise TopologyError(f"cannot listen on {host}:{port} for the job's store ({exc}): free the port or set "
                            "MASTER_PORT to a free one") from exc
    fd = sock.detach()  # from here the store owns the descriptor (it closes it when it is destroyed)
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=fd, use_libuv=True)
    except BaseException:
        try:
            os.close(fd)
        except OSError:  # the store had already closed it
            pass
        raise
    if not store.libuvBackend:  # pragma: no cover - a torch built without libuv
        raise TopologyError("this torch build has no libuv TCPStore server, which a loopback-only store needs; "
                            "install a torch build with libuv (every PyPI build has it)")
    return store
