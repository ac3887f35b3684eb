"""A slow store is not a silent one: the watchdog's verdict on a store that answers late, and on one that never does.

The store sits behind a TCP relay that holds each of the store's replies back (a crowded machine, a store host
busy writing a checkpoint) or drops them all (its host frozen). The rank under test is a generator of a launched
job (rank 1); rank 0, the store's host, beats through a client of its own that bypasses the relay.
"""

import datetime
import socket
import threading
import time

import torch.distributed as dist


class Relay:
    """A TCP relay in front of `port`: each reply of the server reaches the client `delay_s` late (None: never)."""

    def __init__(self, port: int, delay_s: float | None):
        self.upstream, self.delay_s = port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.delay_s), daemon=True).start()

    def _pump(self, src, dst, delay_s):
        while not self.closed.is_set():
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if delay_s is None:  # a frozen host: the request is taken, nothing comes back
                continue
            time.sleep(delay_s)
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self):
        self.closed.set()
        self.listener.close()


def _watch_through(delay_s: float | None, watch_s: float) -> tuple[float | None, str | None]:
    """A generator's liveness asks for the verdict every second (as its watchdog does) for `watch_s`, the store
    behind a relay with `delay_s`, rank 0 beating all along: (seconds to the first verdict, the verdict), or
    (None, None)."""
    from hfllamarl.runtime.world.topology import Topology

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    relay = Relay(store.port, delay_s)
    # collective_timeout_s=1: the heartbeat timeout is its floor, 10 s
    topo = Topology(mode="launcher", rank=1, world_size=2, num_generators=1, timeout_s=1, use_cpu=True,
                    store_addr=("127.0.0.1", relay.port))
    live = topo.liveness
    beating = threading.Event()

    def beat():
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=5))
        while not beating.wait(0.2):
            client.set(live._key("heartbeat", 0), repr(time.time()))

    threading.Thread(target=beat, daemon=True).start()
    started = time.monotonic()
    try:
        while time.monotonic() - started < watch_s:
            verdict = live.verdict()
            if verdict:
                return time.monotonic() - started, verdict
            time.sleep(1.0)
        return None, None
    finally:
        beating.set()
        relay.close()


def test_a_store_that_answers_late_is_not_taken_for_a_frozen_one_and_a_silent_store_still_is():
    """Each reply 1.2 s late, so that one look at the store (six calls) takes 7 s, longer than one store call's
    budget (4 s): the look that overruns is waited for by the next, not left holding the client while every later
    look times out behind it (which made 10 s of silence out of a store answering every 7 s, and a generator give
    up on its live trainer: seen in CI on a loaded machine). A store that never answers is still named within the
    heartbeat timeout (10 s here) and a few seconds. Both watch side by side, each through a relay of its own."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        late, silent = pool.map(lambda delay: _watch_through(delay, 24.0), (1.2, None))
    assert late == (None, None), late
    seconds, verdict = silent
    assert verdict and "which hosts the job's store, stopped answering for 10 s" in verdict, verdict
    assert 10.0 <= seconds < 17.0, seconds


def test_a_call_whose_caller_gave_up_does_not_run_later_behind_a_call_that_hung():
    """The shared store client held by a call that has not come back (10 s here): a later call times out for its
    caller after 4 s, and its helper thread stops waiting for the client then too, rather than queueing behind the
    hung call and running once it returns (calls so queued kept the client busy long after anyone wanted them)."""
    import pytest

    from hfllamarl.runtime.world.store_calls import timed
    from hfllamarl.runtime.world.topology import Topology

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    topo = Topology(mode="launcher", rank=1, world_size=2, num_generators=1, timeout_s=1, use_cpu=True,
                    store_addr=("127.0.0.1", store.port))
    live, ran = topo.liveness, []
    threading.Thread(target=live._locked, args=(lambda c: time.sleep(10.0),), daemon=True).start()
    time.sleep(0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        timed(lambda: live._locked(lambda c: ran.append(time.monotonic())), 4.0)
    assert 3.9 <= time.monotonic() - started < 5.0
    time.sleep(7.5)  # the hung call has come back (at 10.5 s): the abandoned one must not have run after it
    assert ran == []
    assert timed(lambda: live._locked(lambda c: c.check(["nothing"])), 4.0) is False  # the client serves again
