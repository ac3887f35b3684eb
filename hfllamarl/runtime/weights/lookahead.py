"""Lookahead sampling weights (`sampler_lookahead="adamw"`): the generator samples with the policy the trainer is
about to hold, not with the last one it finished.

With `max_staleness = s` a batch is sampled with version v and first trained at version v + s
(`loop.schedule`). The importance weight pi/mu corrects the estimate for the difference, but the samples still show
what version v did: where each step moves the policy far (a run still learning fast), the trainer keeps learning
what it learned a step before, and the run learns less per step than a synchronous one.

AdamW's own state predicts the next update: if the next gradient equalled the running mean of the past ones
(`exp_avg` = m, nine tenths of the next update at beta1 = 0.9), m would stay, the second moment would become
v' = beta2 v + (1 - beta2) m^2, and the parameter would move by lr * m / (1 - beta1^t) / (sqrt(v' / (1 - beta2^t))
+ eps) (after AdamW's decay by lr * weight_decay). The sync sends the weights after that step (`predicted`; `steps`
such steps in general, at most MAX_STEPS in a run). Nothing else changes: the trainer's weights and optimizer state
are only read, the engine records the log-probs of the weights it sampled with as mu (so the loss's correction stays
exact), and a version's number still names the trainer's weights it was predicted from (staleness is counted as
before). Only the sent copy moves, one parameter at a time when a backend reads it, in the weights' own sharding
(FSDP2 shards in, shards out): no second copy of the model.

Measured (docs: Learning under staleness): on the vs-TRL bench it learns per step like a synchronous run; on the
staleness study's task it lost one run in twenty. So it is a setting, not the default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


#: The most optimizer steps the sent weights are moved ahead. One is the step the trainer is about to take; on the
#: staleness study's task, moving them 4 or 16 steps ahead at those staleness levels learned less than not moving
#: them at all (docs: Learning under staleness), so at max_staleness >= 2 the sampler is moved one step closer.
MAX_STEPS = 1


def check_lookahead(value: str, peft_config) -> None:
    """sampler_lookahead='adamw' with LoRA is refused: the sync sends adapters (or the layers merged from them),
    which this prediction does not cover. (The config refuses it with max_staleness=0 and partial rollouts.)"""
    if value == "adamw" and peft_config is not None:
        raise ValueError("sampler_lookahead='adamw' with a peft_config: a LoRA policy's sync sends its adapters (or the "
                         "layers merged from them), which the lookahead does not predict. Remove sampler_lookahead.")


def sampling_weights(spec, weights, tick: int, version: int):
    """What the trainer's sync at `tick` sends, and how many steps ahead: `weights` (policy `version`) as they are,
    or with `spec.lookahead` predicted for the version that will first train the batch the generator starts at
    this tick (`spec.schedule`), at most MAX_STEPS ahead; as they are for an evaluation of `version`, and past the
    last batch."""
    schedule = spec.schedule
    batch = schedule.generator_batch(tick)
    if not spec.lookahead or batch is None or version == 0 or schedule.evaluates(version):
        return weights, 0  # (version 0: no optimizer step yet, so no AdamW state to predict with)
    steps = max(0, min(batch * schedule.iterations - version, schedule.num_steps - version, MAX_STEPS))
    return (LookaheadWeights(weights, spec.model, spec.optimizer, steps) if steps else weights), steps


def _adamw_hyper(optimizer) -> dict[int, dict]:
    """Each parameter's group of `optimizer` (by id)."""
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def predicted(param: torch.Tensor, state: dict, group: dict, steps: int) -> torch.Tensor | None:
    """`param` after `steps` more AdamW steps whose gradients all equal its `exp_avg` (at the next step's learning
    rate), in `param`'s own sharding (a DTensor's local shard is computed and wrapped again). None: no AdamW
    state yet (before the first step) or amsgrad."""
    m, v, step = state.get("exp_avg"), state.get("exp_avg_sq"), state.get("step")
    if m is None or v is None or step is None or group.get("amsgrad"):
        return None
    beta1, beta2 = group["betas"]
    lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group.get("weight_decay", 0.0))
    w, m, v = (_local(x) for x in (param.detach(), m, v))
    m_w, out = m.to(w.dtype), w
    for j in range(1, steps + 1):
        # With every gradient equal to m, m stays and AdamW's second moment is v_j = b2^j v + (1 - b2^j) m^2, so
        # the j-th step is lr / c1 * m / (sqrt(v_j / c2) + eps) = lr / (c1 s) * m / (sqrt(v + r m^2) + eps / s),
        # s = sqrt(b2^j / c2), r = (1 - b2^j) / b2^j: four passes over the weights a step, in place but the first.
        t, keep = float(step) + j, beta2 ** j
        c1, scale = 1.0 - beta1 ** t, math.sqrt(keep / (1.0 - beta2 ** t))
        den = torch.addcmul(v, m, m, value=(1.0 - keep) / keep).sqrt_().add_(eps / scale).to(w.dtype)
        if decay:
            out = out * (1.0 - lr * decay) if out is w else out.mul_(1.0 - lr * decay)
        out = (torch.addcdiv(out, m_w, den, value=-lr / (c1 * scale)) if out is w
               else out.addcdiv_(m_w, den, value=-lr / (c1 * scale)))
    return _like(param, out)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as `param` holds its data: a DTensor with `param`'s mesh and placements, or the tensor itself."""
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


class LookaheadWeights:
    """What the weight sync sends with lookahead sampling: `source.state_dict()` with every trained parameter
    moved `steps` predicted AdamW steps ahead (buffers, frozen parameters and parameters without optimizer state
    as they are). `source`: the policy module (or an object with `state_dict()` over the same tensors)."""

    def __init__(self, source, model: torch.nn.Module, optimizer, steps: int):
        self.source, self.model, self.optimizer, self.steps = source, model, optimizer, steps

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """The sent tensors by name, each computed when it is read (a backend holds one at a time, not a second
        copy of the model)."""
        state = self.source.state_dict()
        if self.steps <= 0:
            return state
        groups = _adamw_hyper(self.optimizer)
        # each trained parameter's storage -> (the parameter, its optimizer group, its AdamW state); tied weights: one
        trained = {_storage(p): (p, groups[id(p)], self.optimizer.state[p]) for p in self.model.parameters()
                   if id(p) in groups and p in self.optimizer.state}
        return _Predicted(state, trained, self.steps)


class _Predicted(Mapping):
    """`state` with each entry whose storage is in `trained` moved `steps` predicted AdamW steps when it is read."""

    def __init__(self, state: dict, trained: dict, steps: int):
        self.state, self.trained, self.steps = state, trained, steps

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.state[name]
        entry = self.trained.get(_storage(t))
        if entry is None:
            return t
        param, group, state = entry
        out = predicted(param, state, group, self.steps)
        return t if out is None else out

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def _storage(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Where a tensor's (local) data is, and its shape: a parameter and its state_dict entry share both."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.data_ptr(), tuple(local.shape)
