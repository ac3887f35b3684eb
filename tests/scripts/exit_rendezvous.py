"""Two ranks started bare (RANK/WORLD_SIZE/MASTER_*: rank 0 trains, rank 1 generates) that only join the job and
exit, with collective_timeout_s=4: `clean` both exit at once; `hung` rank 1 never gets through its interpreter's exit
(a non-daemon thread that never ends, while its heartbeat goes on); `hung-late` rank 1 hangs after the rendezvous (an
exit handler registered before the job's, so run after it, that never returns). Prints `MET <seconds>`: how long the job's own
exit handler (the end-of-job rendezvous, registered when the job starts) took, from the last handler registered
after it to the first registered before it.

    python tests/scripts/exit_rendezvous.py clean|hung|hung-late
"""

import atexit
import os
import sys
import threading
import time

from hfllamarl.runtime.world.topology import init_topology

MARKS = {}


def hang_in_teardown() -> None:
    time.sleep(3600)


def main() -> None:
    if sys.argv[1] == "hung-late" and int(os.environ["RANK"]) == 1:
        atexit.register(hang_in_teardown)  # (registered first: runs last, after the end-of-job rendezvous)
    atexit.register(lambda: print(f"MET {time.monotonic() - MARKS['before']:.3f}", flush=True))  # (runs after it)
    topo = init_topology(num_generator_processes=1, timeout_s=4.0, use_cpu=True)
    topo.liveness.rendezvous("start-up", 60)  # (both ranks up: a rank still starting is judged more slowly)
    if sys.argv[1] == "hung" and topo.rank == 1:
        threading.Thread(target=time.sleep, args=(3600,), name="never-ends").start()  # (not a daemon)
    atexit.register(lambda: MARKS.setdefault("before", time.monotonic()))  # (runs before it)


if __name__ == "__main__":
    main()
