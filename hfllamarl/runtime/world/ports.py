"""A free local port for a store that a launcher (or a bench) hands to the ranks it starts."""

from __future__ import annotations

import glob
import random
import socket


def free_port() -> int:
    """A port free now, chosen below the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be
    taken by any outgoing connection (gloo's, a store client's) before the process that was given it binds it
    (EADDRINUSE, or a rank that cannot reach the store: seen in CI); ports below that range are only ever taken by an
    explicit bind. Drawn from the OS's entropy, not the `random` module (a process that seeds it, as trainers do with
    `set_seed(42)`, would draw the same ports as another one). A port a killed tensor-parallel CPU engine's shared
    memory still names is skipped."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.SystemRandom().randrange(10000, max(low, 10001))
        if glob.glob(f"/dev/shm/*cpushm-{port}*"):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (no free port below the range: fall back to the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
