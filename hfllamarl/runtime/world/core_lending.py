"""Core lending: in a single-process job on a CPU, a generator child that has finished its tick lends its cores to
the trainer.

A single-process CPU job gives the trainer and each generator child cores of their own (`spawn.split_cpus`), so
that generation and training overlap instead of fighting over the same cores. Within a tick the two rarely take
the same time, and the one that finishes first would leave its cores idle until the other is done. Each generator
child writes on a shared board (a small memory-mapped file) the last tick it finished; the trainer looks at it at
every decoder layer of its forward and backward passes, and once every generator has finished the tick the trainer
is in, it runs the rest of its step on every core. It gives them back at the end of its step, before the tick's
channels: no generator can start its next tick before those, so the cores are never used twice.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct

ENV_BOARD = "HFLLAMARL_CORE_BOARD"  # path of the board file, given to each generator child
_SLOT = struct.Struct("<q")


class CoreBoard:
    """One int64 per generator: the last tick it finished (-1: none yet)."""

    def __init__(self, path: str, num_generators: int, create: bool = False):
        self.path, self.num_generators = path, num_generators
        if create:
            with open(path, "wb") as fh:
                fh.write(_SLOT.pack(-1) * num_generators)
        self._fh = open(path, "r+b")
        self._map = mmap.mmap(self._fh.fileno(), _SLOT.size * num_generators)

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

        layers = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))] or [model]
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(lambda module, args: self.poll()))
            self._hooks.append(layer.register_forward_hook(after_forward))

    def close(self) -> None:
        """The job is over: remove the hooks and let go of the board."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.board.close()

    @contextlib.contextmanager
    def lending(self, tick: int):
        """Around the trainer's step of `tick`: borrow the cores once every generator finished `tick`, give them
        back when the step ends."""
        self.tick, self.borrowed = tick, False
        self.poll()
        try:
            yield
        finally:
            self.tick = None
            if self.borrowed:
                import torch

                torch.set_num_threads(len(self.own))
                os.sched_setaffinity(0, self.own)

    def poll(self) -> None:
        if self.tick is None or self.borrowed or not self.board.all_finished(self.tick):
            return
        import torch

        os.sched_setaffinity(0, self.all)  # (the threads torch starts next inherit it)
        torch.set_num_threads(len(self.all))
        self.borrowed = True
