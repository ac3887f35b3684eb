"""`hfllamarl train` with `trainer_replica_groups: G` and no group named: one command starts the G replica groups of
the run, a torchft lighthouse for them, and restarts a group that fails while the others train on.

Each trainer replica group is a whole job of its own (its trainer ranks and its generators: docs/design/elastic.md),
because a launcher stops every rank of its launch when one fails. Started by hand, that is G launches and a
lighthouse; this module makes it one: `hfllamarl train --config recipe.yaml --trainer_replica_groups 2
--max_restarts 3` (without a launcher, without `trainer_replica_group`) checks the recipe once, starts the
lighthouse in this process (unless `torchft_lighthouse` names one), then each group as `hfllamarl train` with the
same recipe and `--trainer_replica_group g` (under `accelerate launch` when the recipe asks for several processes a
group), and watches them:

- a group that ends with an error, or whose first process is stopped (SIGSTOP) for `FROZEN_S`, is started again
  (up to `max_restarts` times each), and trains on: group 0 from its newest checkpoint or a live group's policy, the
  others from a live group's policy (`after_restart`, as under `torchrun --max-restarts`); the other groups are not
  stopped meanwhile;
- once a group has finished the run, a group that fails is not restarted, and one still running after the grace
  (`collective_timeout_s`) is stopped;
- Ctrl-C / SIGTERM stops every group;
- a group that may still be restarted has a standby: a second `hfllamarl train` of the group, started
  `STANDBY_AFTER_S` after the group (so as not to slow its start-up), that has imported the trainer's modules,
  prepared the recipe's data and started its generator children (their vLLM import), then waits on its standard
  input. A restart hands the group to it (`await_go`), which then builds the trainer and trains: the restart skips
  the imports and preparation (`HFLLAMARL_STANDBY_AFTER_S`: the delay, or `off`).

Group 0 writes to `output_dir` (its checkpoints and the final model, as a single job); group g to
`output_dir/replica-group-g`. Each group's lines are printed with `[g<g>] ` in front. On one machine the groups get
equal shares of this process's cores (and of the GPUs, where there are any).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

ENV_GROUP_LAUNCH = "HFLLAMARL_REPLICA_GROUP_LAUNCH"  # the command's pid, in the group jobs it starts
POLL_S = 0.5
FROZEN_S = 5.0  # a group's first process stopped (SIGSTOP) this long is ended, so that it is restarted
ENV_STANDBY = "HFLLAMARL_REPLICA_STANDBY"  # "1" in a group's standby process (it waits for "go" before it trains)
ENV_STANDBY_AFTER = "HFLLAMARL_STANDBY_AFTER_S"  # seconds after a group's start its standby starts; "off": none
STANDBY_AFTER_S = 20.0
STARTED = time.monotonic()  # (when this module was imported: a standby's start, near enough)


def standby_after_s() -> float | None:
    """When a group's standby is started, in seconds after the group (None: no standbys), from ENV_STANDBY_AFTER."""
    value = os.environ.get(ENV_STANDBY_AFTER, "").strip().lower()
    if value in ("off", "no", "false", "none"):
        return None
    try:
        return max(float(value), 0.0) if value else STANDBY_AFTER_S
    except ValueError:
        raise SystemExit(f"hfllamarl train: error: {ENV_STANDBY_AFTER}={value!r}: give seconds (e.g. 20) or off") \
            from None


def await_go(job: dict) -> bool:
    """In a group's standby (ENV_STANDBY): with the recipe prepared, start the group's generator children (they
    import vLLM now), say so, and wait for the command's "go" on standard input. True: train as the group; False:
    the command ended this standby (end of input), its children are stopped."""
    config = job["recipe"].config
    start = time.monotonic()
    prestarted = None if config.trainer_only else config.topology.prestart_children(config.output_dir)
    children = ("no generator of its own: it shares group 0's" if config.trainer_only else
                f"its generator children {'started' if prestarted is not None else 'start when it trains'}")
    print(f"hfllamarl train: standby of replica group {config.trainer_replica_group} ready (process {os.getpid()}, "
          f"prepared in {time.monotonic() - STARTED:.1f} s; {children}): it takes over when the group is restarted",
          file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if line.strip() != "go":
        config.topology.release_prestarted()
        return False
    waited = time.monotonic() - start
    print(f"hfllamarl train: replica group {config.trainer_replica_group} restarted from its standby (process "
          f"{os.getpid()}, ready for {waited:.0f} s)", file=sys.stderr, flush=True)
    return True


def tie_to_supervisor() -> None:
    """In a group this module started: end (SIGTERM) when the command that started it ends, even by SIGKILL, rather
    than train on without its lighthouse (Linux; what it execs, `accelerate launch`, keeps it)."""
    supervisor = os.environ.get(ENV_GROUP_LAUNCH, "")
    if not supervisor.isdigit() or "WORLD_SIZE" in os.environ or not sys.platform.startswith("linux"):
        return  # (the ranks of a group's launch: their launcher is the process tied to the command)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != int(supervisor):  # (it ended before the line above)
        os.kill(os.getpid(), signal.SIGTERM)


def groups_to_start(argv: list[str]) -> int:
    """How many replica groups `hfllamarl train argv` should start itself (0: none, train as one job). It does when
    started without a launcher, not by this module, with `trainer_replica_groups` > 1 and no `trainer_replica_group`
    in the recipe or the flags (a group named is one job of a run launched group by group)."""
    if "WORLD_SIZE" in os.environ or os.environ.get(ENV_GROUP_LAUNCH):
        return 0
    raw = raw_fields(argv)
    try:
        groups = int(raw.get("trainer_replica_groups", 1))
    except (TypeError, ValueError):
        return 0  # (the recipe's own check says what is wrong with it)
    return groups if groups > 1 and "trainer_replica_group" not in raw else 0


def raw_fields(argv: list[str]) -> dict:
    """The recipe file's keys and the flags' values as written (flags win), before any check."""
    import yaml

    out, i = {}, 0
    args = list(argv)
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            if not sep and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            if key == "config":
                try:
                    with open(value) as fh:
                        data = yaml.safe_load(fh)
                except (OSError, yaml.YAMLError):
                    data = None  # (the recipe's own check says why)
                out = {**(data if isinstance(data, dict) else {}), **out}
            else:
                out[key.replace("-", "_")] = value
        i += 1
    return out


def group_argv(argv: list[str], group: int, lighthouse: str, output_dir: str, several: bool) -> list[str]:
    """The arguments of group `group`'s own `hfllamarl train`: the recipe's, its group, the lighthouse, its output
    directory; restarts are this module's, and a launch of several processes a group gets a port of its own."""
    from hfllamarl.runtime.world.ports import free_port

    out = list(argv) + ["--trainer_replica_group", str(group), "--torchft_lighthouse", lighthouse,
                        "--output_dir", output_dir if group == 0 else os.path.join(output_dir, f"replica-group-{group}"),
                        "--max_restarts", "0"]
    out += ["--main_process_port", str(free_port() if several else 0)]
    return out + (["--disable_tqdm", "true"] if group else [])  # (one progress bar: group 0's)


def check_argv(argv: list[str]) -> list[str]:
    """The arguments the recipe is checked with before any group starts (as group 0, with a lighthouse address
    that stands for the one to come)."""
    return list(argv) + ["--trainer_replica_group", "0", "--torchft_lighthouse", "http://127.0.0.1:1",
                         "--max_restarts", "0", "--main_process_port", "0"]


def restarts_asked(argv: list[str]) -> int:
    """The recipe's `max_restarts` (checked: a whole number >= 0)."""
    from .recipe import RecipeError

    value = raw_fields(argv).get("max_restarts", 0)
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise RecipeError(f"max_restarts={value!r}: give a number of restarts >= 0.")
    return n


def shares(items: list, groups: int | list[int]) -> list[list]:
    """`items` (cores or GPUs) cut into consecutive shares, one a group: equal ones for `groups` groups (what is left
    over unused), or in proportion to each group's weight (`groups` a list: its processes), each at least one item
    and what is left over to group 0; [] when there are fewer items than groups."""
    if isinstance(groups, int):
        if len(items) < groups:
            return []
        size = len(items) // groups
        return [items[g * size:(g + 1) * size] for g in range(groups)]
    weights = list(groups)
    if len(items) < len(weights):
        return []
    sizes = [max(1, len(items) * w // sum(weights)) for w in weights]
    while sum(sizes) > len(items):
        sizes[sizes.index(max(sizes))] -= 1
    sizes[0] += len(items) - sum(sizes)
    bounds = [sum(sizes[:g]) for g in range(len(sizes) + 1)]
    return [items[bounds[g]:bounds[g + 1]] for g in range(len(sizes))]


def visible_gpus(count: int) -> list[str]:
    """The first `count` GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (a group's share is named the
    same way, so that a restricted list stays restricted)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(count)]
    return names[:count]


class Supervisor:
    """Starts the groups, restarts a failed one, stops them all at the end (see the module's text).

    Args:
        argv: the `hfllamarl train` arguments (the recipe).
        groups: how many groups; max_restarts: restarts of each; output_dir: the run's (group 0's).
        several: a group is several processes (`accelerate launch`, which `hfllamarl train` starts itself).
        shared: the groups share group 0's generators (`trainer_replica_shared_generators`): every other group is
            one trainer process, started without a launcher, with a share of the machine for that one process.
        grace_s: how long a group may run on once another has finished the run.
        lighthouse: an address to join; None: start one here.
    """

    def __init__(self, argv: list[str], groups: int, max_restarts: int, output_dir: str, several: bool,
                 grace_s: float, lighthouse: str | None = None, gpus_per_group: int = 0, shared: bool = False,
                 processes_per_group: int = 2):
        self.argv, self.groups, self.max_restarts = list(argv), groups, max_restarts
        self.output_dir, self.several, self.grace_s, self.shared = output_dir, several, grace_s, shared
        self._lighthouse_addr, self._lighthouse = lighthouse, None
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts = {g: 0 for g in range(groups)}
        self.started = {g: 0.0 for g in range(groups)}
        self.ended: dict[int, int] = {}  # group -> exit code, once it will not be started again
        # (a group's share of the machine: equal ones, or with shared generators group 0's processes against the
        # others' one each)
        weights = [processes_per_group] + [1] * (groups - 1) if shared else groups
        self._cpus = shares(sorted(os.sched_getaffinity(0)), weights) if hasattr(os, "sched_getaffinity") else []
        gpu_weights = [gpus_per_group] + [1 if shared else gpus_per_group] * (groups - 1)
        self._gpus = shares(visible_gpus(sum(gpu_weights)), gpu_weights) if gpus_per_group else []
        self._stopping = 0  # the signal that asked to stop
        self._copiers: dict[int, list[threading.Thread]] = {}  # pid -> the threads copying its output
        self._prefix: dict[int, list[str]] = {}  # pid -> its lines' prefix (a standby's changes when it is used)
        self._stopped_since: dict[int, float] = {}  # group -> when its first process was first seen stopped
        # group -> its standby process (`await_go`), started `standby_after` s after the group; none for a group of
        # several processes (accelerate launch) or without restarts
        self.standbys: dict[int, subprocess.Popen] = {}
        # (some group is one process: with shared generators, every group but 0)
        self.standby_after = standby_after_s() if max_restarts > 0 and (not several or shared) else None
        self._standby_failed: set[int] = set()  # groups whose standby ended by itself: no other is started

    def lighthouse(self) -> str:
        if self._lighthouse_addr is None:
            from hfllamarl.runtime.training.replica_quorum import start_lighthouse

            # (a group that stops heartbeating, killed or frozen, is left out after 2 s; one alive but late to a
            # step's quorum, e.g. group 0 writing a checkpoint, is waited for up to 10 s before it is left out and
            # must copy the policy again)
            self._lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout_s=2.0, join_timeout_s=10.0)
            self._lighthouse_addr = self._lighthouse.address()
            say(f"started a torchft lighthouse at {self._lighthouse_addr} for {self.groups} trainer replica groups")
        return self._lighthouse_addr

    def start(self, group: int) -> None:
        """Start group `group` (its standby takes over when it has one that is alive)."""
        proc = self._take_standby(group)
        if proc is None:
            proc = self._spawn(group, self.restarts[group])
        self.procs[group], self.started[group] = proc, time.monotonic()

    def _spawn(self, group: int, attempt: int, standby: bool = False) -> subprocess.Popen:
        """A new `hfllamarl train` of group `group` (its restart count `attempt`), with its share of the machine; a
        standby (`await_go`) reads its "go" from a pipe."""
        from hfllamarl.runtime.world.topology import ENV_RESTART_COUNT

        env = {**os.environ, ENV_GROUP_LAUNCH: str(os.getpid()), ENV_RESTART_COUNT: str(attempt), "PYTHONUNBUFFERED": "1"}
        env.pop(ENV_STANDBY, None)
        if standby:
            env[ENV_STANDBY] = "1"
        if self._gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._gpus[group])
        cmd = [sys.executable, "-m", "hfllamarl.cli", "train",
               *group_argv(self.argv, group, self.lighthouse(), self.output_dir, self._several(group))]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.PIPE if standby else None,
                                start_new_session=True, bufsize=1, errors="replace")
        if self._cpus:
            try:
                os.sched_setaffinity(proc.pid, self._cpus[group])  # (before its imports: what it starts inherits it)
            except OSError:
                pass
        prefix = self._prefix[proc.pid] = [f"[g{group} standby] " if standby else f"[g{group}] "]
        self._copiers[proc.pid] = [threading.Thread(target=_copy, args=(stream, out, prefix), daemon=True)
                                   for stream, out in ((proc.stdout.buffer, sys.stdout), (proc.stderr.buffer, sys.stderr))]
        for thread in self._copiers[proc.pid]:
            thread.start()
        return proc

    def _take_standby(self, group: int) -> subprocess.Popen | None:
        """Group `group`'s standby, told to train as the group (None: it has none, or it is gone or stopped)."""
        proc = self.standbys.pop(group, None)
        if proc is None:
            return None
        state = _state(proc.pid)
        if proc.poll() is None and state not in ("T", "t", "Z"):
            try:
                self._prefix[proc.pid][0] = f"[g{group}] "  # (before it can print a line as the group)
                proc.stdin.write("go\n")
                proc.stdin.close()
                return proc
            except (OSError, ValueError):
                pass
        how = "stopped (SIGSTOP)" if proc.poll() is None and state in ("T", "t") else describe(proc.poll())
        say(f"replica group {group}: its standby ({how}) cannot take over; starting a new process")
        _signal_group(proc, signal.SIGKILL)
        _reap(proc)
        return None

    def _keep_standbys(self, finished: bool) -> None:
        """Start the standby of each running group that may still be restarted, `standby_after` s after its start;
        drop one that ended by itself (said, and not started again for that group); none once a group finished."""
        if self.standby_after is None:
            return
        for g, proc in list(self.standbys.items()):
            if proc.poll() is not None:
                del self.standbys[g]
                self._standby_failed.add(g)
                say(f"replica group {g}: its standby ended by itself ({describe(proc.returncode)}; its lines above "
                    "say why); the group's restarts start new processes")
        if finished:
            return
        now = time.monotonic()
        for g, proc in self.procs.items():
            if (g in self.ended or g in self.standbys or g in self._standby_failed or proc.poll() is not None
                    or self._several(g)
                    or self.restarts[g] >= self.max_restarts or now - self.started[g] < self.standby_after):
                continue
            self.standbys[g] = self._spawn(g, self.restarts[g] + 1, standby=True)

    def _several(self, group: int) -> bool:
        """Whether group `group` is several processes (under `accelerate launch`)."""
        return self.several and not (self.shared and group > 0)

    def run(self) -> int:
        """Start every group and watch them until the run ends; returns the exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        finished_at = None
        try:
            for g in range(self.groups):
                self.start(g)
            say(f"started {self.groups} trainer replica groups (group 0 in {self.output_dir}, group g in "
                f"{os.path.join(self.output_dir, 'replica-group-<g>')}); a group that fails is restarted up to "
                f"{self.max_restarts} time(s) while the others train on")
            while len(self.ended) < self.groups:
                if self._stopping:
                    self.stop_all(f"stopped by {signal.Signals(self._stopping).name}")
                    self._drain()
                    return 128 + self._stopping
                for g, proc in list(self.procs.items()):
                    if g not in self.ended and proc.poll() is None:
                        self._end_if_frozen(g, proc)
                    if g in self.ended or proc.poll() is None:
                        continue
                    code, ran = proc.returncode, time.monotonic() - self.started[g]
                    if code == 0:
                        self.ended[g] = 0
                        finished_at = finished_at or time.monotonic()
                        say(f"replica group {g} finished the run ({ran:.0f} s)")
                    elif finished_at is None and self.restarts[g] < self.max_restarts:
                        self.restarts[g] += 1
                        _signal_group(proc, signal.SIGKILL)  # (what is left of it: a generator child, other ranks)
                        self._drain([g])
                        live = sorted(h for h in self.procs if h != g and h not in self.ended)
                        say(f"replica group {g} ended ({describe(code)}) after {ran:.1f} s; starting it again (restart "
                            f"{self.restarts[g]} of {self.max_restarts}); groups {live} train on meanwhile")
                        self.start(g)
                    else:
                        self.ended[g] = code
                        why = ("another group has finished the run" if finished_at is not None
                               else f"its {self.max_restarts} restart(s) are spent")
                        say(f"replica group {g} ended ({describe(code)}) after {ran:.1f} s; not started again: {why}")
                self._keep_standbys(finished_at is not None)
                if finished_at is not None and self.standbys:
                    self._stop_standbys()
                if finished_at is not None and time.monotonic() - finished_at > self.grace_s:
                    self.stop_all(f"a group finished the run {self.grace_s:.0f} s ago")
                    break
                time.sleep(POLL_S)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.stop_all(None)
            self._stop_standbys()
            if self._lighthouse is not None:
                self._lighthouse.shutdown()
        self._drain()
        return self.outcome()

    def _end_if_frozen(self, g: int, proc: subprocess.Popen) -> None:
        """A group whose first process is stopped (SIGSTOP; its trainer, or the launcher of its ranks) will not
        resume by itself: the other groups left it out within the lighthouse's heartbeat timeout, and after
        `FROZEN_S` it is ended here, so that it is started again (a rank frozen under the group's own launcher is
        that launcher's to end: its peers stop within their collective timeout)."""
        if _state(proc.pid) not in ("T", "t"):
            self._stopped_since.pop(g, None)
            return
        since = self._stopped_since.setdefault(g, time.monotonic())
        if time.monotonic() - since >= FROZEN_S:
            self._stopped_since.pop(g, None)
            say(f"replica group {g}: its process {proc.pid} has been stopped for {FROZEN_S:.0f} s (SIGSTOP); ending it")
            _signal_group(proc, signal.SIGKILL)
            _reap(proc)

    def _drain(self, groups=None, timeout_s: float = 5.0) -> None:
        """Let the groups' last lines through before this process says more (their error is read above its own)."""
        for g in self.procs if groups is None else groups:
            for thread in self._copiers.get(self.procs[g].pid, []):
                thread.join(timeout=timeout_s)

    def _stop_standbys(self) -> None:
        """End the standbys and their generator children (they hold nothing of the run's: SIGTERM to each one's
        processes, SIGKILL after 5 s)."""
        standbys, self.standbys = list(self.standbys.values()), {}
        for proc in standbys:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in standbys:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                _reap(proc)

    def outcome(self) -> int:
        """0 when group 0 finished the run (its model is the run's, in output_dir); else 1, saying what happened."""
        codes = {g: self.ended.get(g, self.procs[g].returncode) for g in range(self.groups)}
        done = [g for g, c in codes.items() if c == 0]
        if codes[0] == 0:
            lost = [g for g in range(self.groups) if codes[g] != 0]
            say(f"run finished; model saved to {self.output_dir}"
                + (f" (group(s) {lost} did not reach the end: see their lines above)" if lost else ""))
            return 0
        where = (f"; group {done[0]} finished the run: its model is in "
                 f"{os.path.join(self.output_dir, f'replica-group-{done[0]}')}" if done else "")
        say(f"error: replica group 0 ended ({describe(codes[0])}), its restarts spent; its own error is in its [g0] "
            f"lines above{where}. Start the run again with the same command: group 0 resumes from its newest "
            "checkpoint in the output directory (resume_from_checkpoint: true).")
        return 1

    def _on_signal(self, signum, frame) -> None:
        self._stopping = signum

    def stop_all(self, why: str | None, grace_s: float = 20.0) -> None:
        """Stop the groups still running: SIGTERM to each group's processes, SIGKILL after `grace_s`."""
        live = {g: p for g, p in self.procs.items() if p.poll() is None}
        if not live:
            return
        if why:
            say(f"stopping replica group(s) {sorted(live)}: {why}")
        for p in live.values():
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for g, p in live.items():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                _reap(p)
            self.ended.setdefault(g, p.returncode)


def _reap(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Wait for a process sent SIGKILL (one stuck in the kernel may take a while: then it is left, and said)."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        say(f"process {proc.pid} has not ended {timeout_s:.0f} s after SIGKILL; going on without it")


def _state(pid: int) -> str:
    """A process's state letter from /proc (R, S, D, T stopped, t traced, Z...); "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # (the group's accelerate launcher, its ranks and their generator children)
    except (ProcessLookupError, PermissionError):
        pass


_open_lines: dict[int, bool] = {}  # id(output) -> whether its last write left a line open (a progress bar's "\r")


def _copy(stream, out, prefix: list[str]) -> None:
    """A group's output (`stream`, bytes), line by line, with its prefix (`prefix[0]`, read at each line); read to
    the end whatever happens to `out` (a group whose pipe filled up would stop). A progress bar stays one line: a
    piece ending in "\r" is written with its "\r" (the next redraws the line in place, prefix included), and a
    blank piece (the bar clearing its line, or ending it) as it is, not as an empty prefixed line."""
    for piece in io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline=""):  # (split at \r too)
        if out is None:
            continue
        try:
            out.write(piece if not piece.strip() else prefix[0] + piece)
            out.flush()
            _open_lines[id(out)] = not piece.endswith("\n")
        except (OSError, ValueError):
            out = None


def describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def say(text: str) -> None:
    """The command's own line, on a line of its own (after a group's progress bar, not over it)."""
    start = "\n" if _open_lines.get(id(sys.stderr)) else ""
    print(f"{start}hfllamarl train: {text}", file=sys.stderr, flush=True)
