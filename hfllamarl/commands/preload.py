"""`hfllamarl preload`: keep a preloaded process server for the single-process jobs started from this shell.

    hfllamarl preload [--socket PATH] [--owner PID] &
    export HFLLAMARL_PRELOAD=PATH        # the line it prints (PATH: --socket's, or a new private one)

A single-process job (`python train.py`) starts one generator process per generator rank, and each imports
torch, transformers and vLLM before it can build its engine: seconds of a core, on the way to the first step.
This server imports them once and forks the generator processes of every job that names it in
`HFLLAMARL_PRELOAD`, in milliseconds (`hfllamarl.runtime.world.preload`). It serves this user only, runs until
its owner (by default the shell that started it) exits or it is interrupted, and is refused by a job whose Python,
package versions or source files differ from what it imported (that job spawns its generators, with a warning).
Jobs under a launcher (torchrun, accelerate) do not use it: their ranks are the launcher's.
"""

from __future__ import annotations

import os
import sys


def add_arguments(parser) -> None:
    parser.add_argument("--socket", default=None,
                        help="the server's unix socket (default: in a new private directory under the temporary "
                             "directory); its directory, made (0700) if it does not exist, must be yours and closed "
                             "to others")
    parser.add_argument("--owner", type=int, default=None,
                        help="exit when this process exits (default: the process that started the command)")


def run(args) -> int:
    import tempfile

    from hfllamarl.runtime.world import preload

    if not preload.enabled_here():
        raise SystemExit("hfllamarl preload: this platform has no fork() or pidfd_open(): jobs spawn their "
                         "generator processes")
    if args.socket is None:
        path = os.path.join(tempfile.mkdtemp(prefix="hfllamarl-preload-"), "s")
    else:
        path = os.path.abspath(os.path.expanduser(args.socket))
        where = os.path.dirname(path)
        os.makedirs(where, mode=0o700, exist_ok=True)
        st = os.stat(where)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise SystemExit(f"hfllamarl preload: {where} must be your own directory, not writable by others "
                             "(anyone who can write there could stand in for the server)")
    owner = args.owner or os.getppid()
    print(f"export {preload.ENV_PRELOAD}={path}", flush=True)
    print(f"(importing vLLM; jobs that name this server fork their generator processes from it; it exits with "
          f"process {owner})", file=sys.stderr, flush=True)
    # (the server's own command line, with room for its children's: `ps` shows each one's as if spawned)
    os.execve(sys.executable, [sys.executable, "-m", "hfllamarl.runtime.world.preload_server", "--socket", path, "--owner",
                               str(owner), "--room", " " * preload.ROOM],
              {**os.environ, preload.ENV_ROOM: " " * preload.ENV_ROOM_SIZE})
