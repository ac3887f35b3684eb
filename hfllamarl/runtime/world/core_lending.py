"""Core lending: in a single-process job on a CPU, whichever side is idle lends its cores to the other.

A single-process CPU job gives the trainer and each generator child cores of their own (`spawn.split_cpus`), so
that generation and training overlap instead of fighting over the same cores. Within a tick the two rarely take
the same time, and the one that finishes first would leave its cores idle until the other is done. Both directions
go through a shared board (a small memory-mapped file):

- **generators to the trainer.** Each generator child writes the last tick it finished; the trainer looks at it at
  every decoder layer of its forward and backward passes, and once every generator has finished the tick the
  trainer is in, it runs the rest of its step on every core. It gives them back at the end of its step, before the
  tick's channels: no generator can start its next tick before those, so the cores are never used twice.
- **the trainer to the generators.** The trainer writes whether it is waiting (from the start of a tick, through
  its channels, until its step begins: nothing of its own to compute). A generator looks at it before every decoder
  layer of its engine's forward pass; while the trainer waits, it decodes on its own cores and its share of the
  trainer's (`CoreBorrower`), and gives them back as soon as the trainer has work (its step began) and at the end
  of its own step, before its rollouts go out: the trainer cannot start the step they feed before that.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time

ENV_BOARD = "HFLLAMARL_CORE_BOARD"  # path of the board file, given to each generator child
ENV_LENT = "HFLLAMARL_LENT_CPUS"  # the trainer's cores a generator child may use while the trainer waits ("0,1")
_SLOT = struct.Struct("<q")


class CoreBoard:
    """One int64 per generator: the last tick it finished (-1: none yet); then one for the trainer: 1 while it waits
    (its cores idle), else 0."""

    def __init__(self, path: str, num_generators: int, create: bool = False):
        self.path, self.num_generators = path, num_generators
        if create:
            with open(path, "wb") as fh:
                fh.write(_SLOT.pack(-1) * num_generators + _SLOT.pack(0))
        self._fh = open(path, "r+b")
        self._map = mmap.mmap(self._fh.fileno(), _SLOT.size * (num_generators + 1))

    def trainer_waits(self, waiting: bool) -> None:
        _SLOT.pack_into(self._map, _SLOT.size * self.num_generators, int(waiting))

    def trainer_waiting(self) -> bool:
        return _SLOT.unpack_from(self._map, _SLOT.size * self.num_generators)[0] == 1

    def finished(self, generator: int, tick: int) -> None:
        _SLOT.pack_into(self._map, _SLOT.size * generator, tick)

    def all_finished(self, tick: int) -> bool:
        return all(_SLOT.unpack_from(self._map, _SLOT.size * g)[0] >= tick for g in range(self.num_generators))

    def close(self) -> None:
        self._map.close()
        self._fh.close()


def open_board(num_generators: int) -> CoreBoard | None:
    """In a generator child: the board its parent made (None: no core lending in this job)."""
    path = os.environ.get(ENV_BOARD)
    return CoreBoard(path, num_generators) if path else None


def open_borrower(board: CoreBoard | None) -> CoreBorrower | None:
    """In a generator child: what it borrows of the trainer's cores while the trainer waits (None: nothing)."""
    lent = [int(c) for c in os.environ.get(ENV_LENT, "").split(",") if c.strip()]
    if board is None or not lent or not hasattr(os, "sched_getaffinity"):
        return None
    return CoreBorrower(board, sorted(os.sched_getaffinity(0)), lent)


def lent_cpus(trainer_cpus: list[int], num_generators: int, generator: int) -> list[int]:
    """The trainer's cores generator `generator` may borrow while the trainer waits: every num_generators-th one
    from its place (none when there are more generators than trainer cores past the first ones)."""
    return list(trainer_cpus[generator::num_generators])


def _layers(model) -> list:
    """The modules a lender or borrower looks at the board before: the decoder layers (else the whole model)."""
    return [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))] or [model]


def _run_on(cpus: list[int]) -> None:
    """This thread, and the threads torch's intra-op pool starts from here, on `cpus`, one thread each.
    (`torch._C.set_num_threads`: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op once it has
    placed its threads.)"""
    import torch

    os.sched_setaffinity(0, cpus)  # (the threads torch starts next inherit it)
    torch._C.set_num_threads(len(cpus))


class CoreLender:
    """The trainer's side: its own cores, every core of the job, and the hooks that switch between them."""

    def __init__(self, board: CoreBoard, own_cpus: list[int], all_cpus: list[int]):
        self.board, self.own, self.all = board, list(own_cpus), list(all_cpus)
        self.tick: int | None = None  # the tick whose step is running (None: no step, nothing to borrow)
        self.borrowed = False  # whether the current (or last) step runs part of its work on borrowed cores
        self._hooks: list = []

    def install(self, model) -> None:
        """Look at the board before every decoder layer's forward and backward pass."""
        import torch

        def before_backward(grad):
            self.poll()
            return grad

        def after_forward(module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(before_backward)  # runs when the backward pass reaches this layer

        for layer in _layers(model):
            self._hooks.append(layer.register_forward_pre_hook(lambda module, args: self.poll()))
            self._hooks.append(layer.register_forward_hook(after_forward))

    def close(self) -> None:
        """The job is over: remove the hooks and let go of the board."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.board.close()

    def waits(self) -> None:
        """A tick began: until its step, the trainer only waits on its channels (the generators may use its
        cores)."""
        self.board.trainer_waits(True)

    def busy(self) -> None:
        """The trainer has work (its step began): a generator using its cores gives them back."""
        self.board.trainer_waits(False)

    @contextlib.contextmanager
    def lending(self, tick: int):
        """Around the trainer's step of `tick`: borrow the cores once every generator finished `tick`, give them
        back when the step ends."""
        self.busy()
        self.tick, self.borrowed = tick, False
        self.poll()
        try:
            yield
        finally:
            self.tick = None
            if self.borrowed:
                _run_on(self.own)

    def poll(self) -> None:
        if self.tick is None or self.borrowed or not self.board.all_finished(self.tick):
            return
        _run_on(self.all)
        self.borrowed = True


class CoreBorrower:
    """A generator child's side: its own cores, the trainer's cores it may use while the trainer waits, and the
    hooks on its engine's decoder layers that switch between them."""

    def __init__(self, board: CoreBoard, own_cpus: list[int], lent_cpus: list[int]):
        self.board, self.own = board, list(own_cpus)
        self.wide = sorted(set(own_cpus) | set(lent_cpus))
        self.borrowed = False
        self.seconds = 0.0  # how long it ran on the trainer's cores since its last `end_tick`
        self._since = 0.0
        self._hooks: list = []

    def install(self, model) -> None:
        """Look at the board before every decoder layer's forward pass of the engine's model (in this process)."""
        for layer in _layers(model):
            self._hooks.append(layer.register_forward_pre_hook(lambda module, args: self.poll()))

    def poll(self) -> None:
        waiting = self.board.trainer_waiting()
        if waiting and not self.borrowed:
            _run_on(self.wide)
            self.borrowed, self._since = True, time.perf_counter()
        elif self.borrowed and not waiting:
            self.give_back()

    def give_back(self) -> None:
        """Back on its own cores (the trainer has work, or this generator's sampling ended)."""
        if self.borrowed:
            _run_on(self.own)
            self.borrowed = False
            self.seconds += time.perf_counter() - self._since

    def end_tick(self) -> float:
        """Its sampling of the tick is done: back on its own cores; the seconds it ran on the trainer's meanwhile."""
        self.give_back()
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        self.give_back()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
