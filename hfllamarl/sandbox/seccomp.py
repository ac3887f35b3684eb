"""The call's system-call filter (seccomp-BPF): which sockets model code may open, whatever path it takes.

The mount namespace shows the host's file system read-only, but a read-only mount does not stop ``connect()`` to a
Unix socket file on it (the preload server's, a database's, a container runtime's): a job that does not run as root
maps its own uid into the call, and that uid may write to the sockets the job created. So the filter, installed in
the call before its code runs (after ``no_new_privs``; it cannot be lifted, and children inherit it), refuses:

- ``socket()`` of every family but ``AF_INET``/``AF_INET6`` (in namespaces mode, where the call's network namespace
  has nothing to reach) or of every family (process mode, which shares the host's network): no Unix, netlink,
  packet or vsock socket can be made, so no socket file is reachable by path;
- ``socketpair()`` but ``SOCK_STREAM`` pairs (``multiprocessing`` and ``asyncio`` use them; a stream pair is
  connected already, while a datagram one could be pointed at a socket file);
- ``io_uring_setup()`` (its ring opens and connects sockets without those system calls);
- every system call of another ABI (32-bit, x32): the process is killed.

Refused calls fail with ``EACCES`` (``ENOSYS`` for io_uring, as on a kernel without it). Architectures: x86_64 and
aarch64; elsewhere the step fails and the sandbox refuses to start (fail closed).
"""

from __future__ import annotations

import ctypes
import platform
import socket

__all__ = ["ARCHES", "install", "program"]

# (audit arch, socket, socketpair, io_uring_setup, lowest number of a foreign ABI sharing the arch: x32)
ARCHES = {"x86_64": (0xC000003E, 41, 53, 425, 0x40000000), "aarch64": (0xC00000B7, 198, 199, 425, None)}
_LD_W_ABS, _JEQ_K, _JGE_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24  # offsets in struct seccomp_data (little-endian: an arg's low word first)
_EACCES, _ENOSYS = 13, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def program(allow_inet: bool, machine: str | None = None) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; jumps name labels until they are resolved here."""
    arch, nr_socket, nr_socketpair, nr_io_uring, foreign = ARCHES[machine or platform.machine()]
    families = (socket.AF_INET, socket.AF_INET6) if allow_inet else ()
    code: list[tuple] = [
        (_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, "next", "kill", arch),
        (_LD_W_ABS, 0, 0, _NR),
        *([(_JGE_K, "kill", "next", foreign)] if foreign is not None else []),
        (_JEQ_K, "socket", "next", nr_socket),
        (_JEQ_K, "socketpair", "next", nr_socketpair),
        (_JEQ_K, "enosys", "next", nr_io_uring),
        (_RET_K, 0, 0, _RET_ALLOW),
        "socket", (_LD_W_ABS, 0, 0, _ARG0),
        *[(_JEQ_K, "allow", "next", family) for family in families],
        (_RET_K, 0, 0, _RET_ERRNO | _EACCES),
        "socketpair", (_LD_W_ABS, 0, 0, _ARG1), (_AND_K, 0, 0, 0xF),  # (the type without its NONBLOCK/CLOEXEC flags)
        (_JEQ_K, "allow", "next", socket.SOCK_STREAM),
        (_RET_K, 0, 0, _RET_ERRNO | _EACCES),
        "allow", (_RET_K, 0, 0, _RET_ALLOW),
        "enosys", (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS),
        "kill", (_RET_K, 0, 0, _RET_KILL_PROCESS),
    ]
    labels, out = {}, []
    for item in code:
        if isinstance(item, str):
            labels[item] = len(out)
        else:
            out.append(item)
    resolved = []
    for i, (op, jt, jf, k) in enumerate(out):
        jump = (lambda target: 0 if target in (0, "next") else labels[target] - i - 1)
        resolved.append((op, jump(jt), jump(jf), k))
    return resolved


def install(allow_inet: bool, libc) -> int:
    """Installs the filter on the calling thread (and what it forks); returns prctl's result (-1: errno set).
    The caller must have set ``no_new_privs`` (or hold CAP_SYS_ADMIN)."""
    code = program(allow_inet)
    filters = (_Filter * len(code))(*[_Filter(*instruction) for instruction in code])
    prog = _Program(len(code), filters)
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)
