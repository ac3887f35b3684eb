"""The extension points: what a plugin of each entry-point group provides, when it is called, what it may log.

| entry-point group         | the entry point names                        | contract               |
|---------------------------|----------------------------------------------|------------------------|
| `hfllamarl.algorithms`    | a class                                      | `Algorithm`            |
| `hfllamarl.rewards`       | a function (or callable object)              | `RewardFunction`       |
| `hfllamarl.weight_sync`   | a subclass of `WeightSyncBackend`            | `WeightSyncBackend`    |
| `hfllamarl.environments`  | a class (or factory) returning an environment | `Environment`         |

A plugin imports the public core (this module, `hfllamarl.losses`, `hfllamarl.policy_loss`, `hfllamarl.weight_sync`,
`hfllamarl.sandbox`), never the runtime, and the core never imports a plugin. The docs' plugins guide
(docs/guides/plugins.md) documents each method below; a test keeps the two in step.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # the core's types, for annotations only
    import torch

    from hfllamarl.runtime.world.topology import Topology

Box = tuple[tuple[int, int], ...]  # one [start, end) per dimension of a weight


@runtime_checkable
class Algorithm(Protocol):
    """Advantages and the loss (group `hfllamarl.algorithms`; built-ins: aipo, grpo, rloo, on_policy_pg).

    Built once on every trainer rank as `cls(**options)`, with the options its `__init__` names among
    `ALGORITHM_OPTIONS` (config values); a config option the algorithm does not name is refused at start-up when
    it is set, so nothing the user sets is ignored.
    """

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Called once per trainer step on every trainer rank with the rewards of that rank's groups, `[N]`
        float32, the G = `group_size` completions of each prompt contiguous; NaN for a completion that every reward
        function left unscored (None), as TRL. Returns `[N]` advantages (a NaN one is trained as 0)."""
        ...

    def loss(self, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Called once per micro-batch, before its backward pass. A `loss` that also names a `shape` parameter
        gets the step's `hfllamarl.losses.StepShape` (its tokens on every rank, micro-batches, ranks,
        max_completion_length), for normalisations over the whole step (`hfllamarl.losses.aggregate`). The
        trainer may pass `old_logprobs` (`[B, T]` log pi_old, the policy before the batch's first optimizer step)
        and `entropy_mask` (`[B, T]` 0/1) only to a `loss` that names them (`hfllamarl.policy_loss.PolicyLoss`).

        Args:
            logprobs: `[B, T]` log pi of the sampled tokens under the current policy, with gradient.
            behavior_logprobs: `[B, T]` log mu, the generator's log-prob when it sampled the token (maybe stale).
            advantages: `[B]`, this micro-batch's rows of `advantages()`.
            mask: `[B, T]` 1 on completion tokens, 0 on padding (and on a truncated completion's tokens with
                `mask_truncated_completions`).
            ref_logprobs: `[B, T]` log-probs under the frozen reference model when `beta > 0`, else None; the
                algorithm adds its KL term (`hfllamarl.losses.add_kl`).
        Returns:
            the scalar loss of the micro-batch (the trainer divides by the number of micro-batches), and metrics:
            every name reaches the logs as it is, averaged over micro-batches and trainer ranks, except names
            ending in `/max` (the maximum) and `/min` (the minimum).
        """
        ...


#: Options an algorithm's `__init__` may name, and the config field each comes from.
ALGORITHM_OPTIONS = {"rho": "aipo_rho", "scale_rewards": "scale_rewards", "epsilon": "epsilon",
                     "epsilon_high": "epsilon_high", "delta": "delta", "beta": "beta", **{name: name for name in (
                         "loss_type", "importance_sampling_level", "off_policy_mask_threshold",
                         "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                         "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
                         "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
                         "vespo_k_neg", "vespo_lambda_neg", "use_bias_correction_kl", "off_policy_correction",
                         "off_policy_correction_kwargs")}}

#: Why a field an algorithm does not take is refused, beyond "it does not use it".
_NOT_TAKEN_HINTS = {
    "beta": " (beta > 0 needs an algorithm that adds the KL term).",
    **{field: " (the behaviour-policy correction pi_old/mu and its modes come with algorithm='aipo', the default, "
              "whose aipo_rho bounds the same weight, 'grpo' or 'rloo')."
       for field in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                     "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
                     "off_policy_correction", "off_policy_correction_kwargs")},
}


def algorithm_kwargs(name: str, cls: type, config: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """The options to build algorithm `name` (class `cls`) with, from `config`; a config field the algorithm does
    not take, set to something other than its default (`defaults`, by field name), is refused."""
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {}
    for option, field in ALGORITHM_OPTIONS.items():
        value = getattr(config, field)
        if option in params or takes_any:
            kwargs[option] = value
        elif value != defaults[field]:
            takes = sorted(field_ for opt, field_ in ALGORITHM_OPTIONS.items() if opt in params)
            raise ValueError(f"AsyncAIPOConfig: `{field}={value!r}` is set, but the {name!r} algorithm does not use it "
                             f"(it takes {', '.join(takes) or 'no options'}). Remove it, or choose an algorithm that "
                             "does" + _NOT_TAKEN_HINTS.get(field, "."))
    return kwargs


@runtime_checkable
class OffPolicyCorrection(Protocol):
    """An off-policy correction (group `hfllamarl.corrections`; built-ins: aipo, token_truncate, token_mask,
    sequence_truncate, sequence_mask, coupled, decoupled, a3po, m2po, ess), built with the options of
    `off_policy_correction_kwargs` and taken by the `aipo`, `grpo` and `rloo` losses (`hfllamarl.policy_loss`).

    `level` is "token" or "sequence" (the shape of its weight; vespo takes token-level ones only). It may also
    define `step_scale(sequence_log_weights) -> (factor, metrics)`: called once per optimizer step on every trainer
    rank with log(pi_old/mu) of every sequence of the step (all ranks), it scales that step's learning rate.
    """

    level: str

    def __call__(self, old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                 staleness: torch.Tensor | None = None) -> Any:
        """Called once per micro-batch in the loss with `[B, T]` log pi_old, log mu, the completion mask and each
        token's staleness in policy versions; returns an `hfllamarl.corrections.Corrected` (the behaviour weight,
        the anchor of the trust-region ratio, the share it bounded, metrics)."""
        ...


@runtime_checkable
class RewardFunction(Protocol):
    """A reward function with TRL's contract (group `hfllamarl.rewards`; built-ins: math_sympy, gsm8k,
    boxed_format, length). Called on the trainer ranks once per trainer step with that rank's completions, and by
    `hfllamarl eval`:

        fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_metric=..., log_extra=...,
           **dataset_columns) -> list[float | None]

    `log_metric(name, value)` logs a scalar under `name` (averaged over the step's calls on every trainer rank) and
    `log_extra(column, values)` adds a column to the completions table (`log_completions`), as in TRL.
    `completions` are strings, or `[{"role": "assistant", "content": ...}]` when the prompts are chat messages.
    One value per completion; None: this function does not score that sample. `async def` functions run
    concurrently. A function may also have `stats() -> dict[str, float]`: every entry is logged after each step
    as `rewards/<function name>/<key>`. Model output is untrusted: bound the time of anything a completion
    drives (the built-ins run it in a sandboxed process with a timeout).
    """

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        ...


@runtime_checkable
class Environment(Protocol):
    """An environment with TRL's `environment_factory` contract (group `hfllamarl.environments`; built-ins:
    calculator, python_sandbox). The entry point names a class (or any factory): `environment_factory="name"`
    builds one instance per rollout, on the generator's first rank only, and reuses instances across batches.

    Tools: every public method other than `reset` and `get_reward`, sync or `async def`, with type hints and a
    Google-style docstring (the schema the model reads); called with the arguments the model wrote, each call
    bounded by `tool_call_timeout_s`; what it returns (or the error it raises) is the tool message the model reads.
    Model output only chooses the method and its arguments: a tool that runs them as code must sandbox them.
    """

    def reset(self, **row: Any) -> str | None:
        """Called before each rollout with the dataset row's columns (TRL passes the `prompt` too); a string is
        appended to the content of the prompt's last message."""
        ...

    # Optional, so not part of the runtime check:
    #     def get_reward(self) -> float
    # called once when the rollout finishes, next to the live environment; the score is a reward named after the
    # class (weight 1), logged as `rewards/<class name>/mean`. It runs in a thread of its own, alongside the other
    # finishing rollouts' get_reward, bounded by `tool_call_timeout_s`: past it the rollout is unscored by it (None,
    # as TRL's NaN), whatever `reward_errors` says; one that raises follows `reward_errors`.


class WeightSyncBackend:
    """Moves the trainer's policy weights to the generator ranks (group `hfllamarl.weight_sync`; built-ins:
    nccl_ddma, broadcast, disk). The entry point names a subclass; it is built on every rank as
    `cls(topology, transfer_dtype=...)`. The `policy_weights` channel decides when weights move (it tells the
    generator which version follows) and to which replicas (`targets`, set on every rank before each
    `send`/`receive`), the backend how.

    With several generator replicas and generator_failure="continue", a send to a replica that is lost raises
    `hfllamarl.runtime.world.liveness.ReplicaLostError` from the channel helpers (`hfllamarl.runtime.loop.channels`); a
    backend catches it, leaves that replica out and finishes the others (`hfllamarl.runtime.loop.weights_channel.settle`)."""

    def __init__(self, topology: Topology, transfer_dtype: str | torch.dtype | None = None, **options):
        import torch

        self.topology = topology
        self.options = options
        # Weights travel in this dtype (e.g. bfloat16 for a bf16 generator of an fp32 trainer: half the
        # bytes); None keeps the trainer's. The trainer casts before sending, so what a generator receives
        # is bitwise the trainer's weights cast to it.
        if isinstance(transfer_dtype, str):
            transfer_dtype = None if transfer_dtype == "auto" else getattr(torch, transfer_dtype)
        self.transfer_dtype = transfer_dtype
        self.targets: list[int] | None = None  # the replicas the next send/receive reaches (None: every replica)

    @property
    def target_ranks(self) -> list[int]:
        """The generator ranks of the replicas the next sync reaches (`targets`), in replica order."""
        topo = self.topology
        replicas = self.targets if self.targets is not None else range(topo.num_replicas)
        return [g for r in replicas for g in topo.replica_ranks(r)]

    @property
    def device(self) -> torch.device:
        """Where this rank's weight buffers live: the CPU, or this process's GPU."""
        import torch

        if self.topology.use_cpu:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a weight of `dtype` travels in."""
        return self.transfer_dtype or dtype

    def setup_trainer(self, model: torch.nn.Module) -> None:
        """Called once on every trainer rank, after the policy is sharded, before the first send."""

    def setup_generator(self, loader_boxes=None) -> None:
        """Called once on every generator rank, after its vLLM engine is built, before the first receive.
        `loader_boxes(weights)`, given `[(name, shape)]`, returns for each weight the box this rank's engine
        reads (None: none of it), from vLLM's own loaders; a backend may use it to send each rank only that."""

    def send(self, model: torch.nn.Module) -> None:
        """Called on every trainer rank each time new weights go out (`model.state_dict()`: the policy, or for a
        LoRA policy its merged weights)."""
        raise NotImplementedError

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Called on every generator rank each time new weights come in: yields (HF name, full-size tensor)
        for the whole weight set, in order, as the tensors arrive."""
        raise NotImplementedError

    def region(self, name: str, generator_rank: int) -> Box | None:
        """Called by checks: the box of weight `name` that `generator_rank` receives valid data for (None for
        the whole tensor)."""
        return None

    def receives(self, name: str, generator_rank: int) -> bool:
        """Called by checks: whether `receive()` on `generator_rank` yields weight `name` at all."""
        return True
