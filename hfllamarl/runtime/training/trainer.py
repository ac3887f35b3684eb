"""The trainer executor: scores rollouts, computes advantages and takes `num_iterations` optimizer steps per batch.

The policy is sharded with FSDP2 over the trainer world. At tick t the trainer trains on
generation batch `t - max_staleness` (its rows arrived over the `rollouts` channel), and offers
its newest weights on the `policy_weights` channel whenever the generator still has batches to
sample. Each optimizer pass over the batch is one policy version and one step of the run
(`hfllamarl.runtime.loop.schedule`); the passes after the first clip against the policy before the first
(`hfllamarl.runtime.training.iterations`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hfllamarl.losses import StepShape, normalize_then_sum_advantages

from hfllamarl.runtime.training.batching import completion_logprobs, loss_side
from hfllamarl.runtime.training.moe import balancing_loss_fn
from hfllamarl.runtime.training.shared_prompts import Layout
from hfllamarl.runtime.loop.executor import Executor, wait_for_startup
from hfllamarl.corrections import sequence_log_weights
from hfllamarl.runtime.training.iterations import (high_entropy_mask, loss_keywords, mix_reference, rows_to_train,
                                                   forward_only_plan, scaled_lr, scales_steps, skips_flat_backward,
                                                   skips_flat_rows, step_scale, token_staleness)
from hfllamarl.runtime.training.finite import (NonFiniteError, agree, first_bad_gradient, nonfinite_problems,
                                               total_grad_norm)
from hfllamarl.runtime.training.rank_metrics import all_max as _all_max, all_sum as _all_sum, evaluation_metrics
from hfllamarl.runtime.training.rank_metrics import gather_samples, logged_means as _logged_means, reduce_metrics
from hfllamarl.runtime.training.rank_metrics import step_metrics
from hfllamarl.runtime.training.replica_step import replica_gradients
from hfllamarl.runtime.data.rewards import RewardRunner
from hfllamarl.runtime.training import shared_rewards
from hfllamarl.runtime.training.dynamic_sampling import GroupFilter, join_scored, split_scored
from hfllamarl.runtime.loop.rollout import ROLLOUTS, Rollout, RolloutGroup
from hfllamarl.runtime.loop.sampling import Sampling, within_support
from hfllamarl.runtime.loop.schedule import Schedule
from hfllamarl.runtime.world import startup
from hfllamarl.runtime.weights.tensor_parallel import reduce_partial_gradients
from hfllamarl.runtime.world.mesh import data_world_size
from hfllamarl.runtime.world.topology import Topology
from hfllamarl.runtime.loop.weights_channel import POLICY_WEIGHTS, WeightSyncBackend
from hfllamarl.runtime.weights.hf_export import export_for_verify
from hfllamarl.runtime.weights.lookahead import sampling_weights

logger = logging.getLogger(__name__)

@dataclass
class TrainerSpec:
    """What the trainer executor needs, built by the `AsyncAIPOTrainer` front-end."""

    model: torch.nn.Module  # already sharded with FSDP2
    optimizer: torch.optim.Optimizer
    scheduler: Any
    algorithm: Any
    rewards: RewardRunner
    backend: WeightSyncBackend
    schedule: Schedule  # which batch each tick trains, until when the generator samples
    num_generations: int
    micro_batch_size: int
    sampling: Sampling  # the transforms vLLM samples under (temperature, top-p/k, min-p, penalties)
    max_grad_norm: float | None
    pad_token_id: int
    device: torch.device
    on_step: Callable[[int, dict], bool] = lambda step, metrics: False  # returns: is a checkpoint due
    should_stop: Callable[[], bool] = lambda: False  # a callback asked to end the run (should_training_stop)
    save_checkpoint: Callable[[int], None] = lambda step: None  # writes this rank's part, then commits
    trainer_state: Any = None
    weights: Any = None  # what the weight sync sends (`state_dict()`); None: the policy itself (LoRA: merged)
    ref_model: Any = None  # with beta > 0: the frozen reference policy, sharded like the policy (the algorithm
    # adds the KL term from the reference log-probs it is given)
    verify_dir: Callable[[int], str] | None = None  # verify_weight_sync: where policy version v is exported
    startup_timeout_s: float = 240.0  # how long the ranks wait for each other's start-up (vllm_server_timeout)
    max_completion_length: int | None = None  # Dr. GRPO's normalisation constant
    mask_truncated_completions: bool = False  # a completion cut at max_completion_length is not trained on
    on_samples: Callable[[dict | None], None] | None = None  # log_completions: gets the step's samples (rank 0)
    on_eval: Callable[[dict], None] = lambda metrics: None  # evaluation during training: logs the eval_* metrics
    dynamic_sampling_groups: int = 0  # drop_zero_variance_groups: this rank's groups per step (0: off)
    padding_free: bool = True  # pack micro-batches without padding (`hfllamarl.runtime.training.batching`) if the model allows
    share_prompts: bool = True  # a group's prompt computed once where it pays (`hfllamarl.runtime.training.shared_prompts`)
    pad_to_multiple_of: int | None = None  # round the micro-batch's width up to a multiple of this
    tools: bool = False  # tool calling (tools / environment_factory): log TRL's tools/* metrics
    router_aux_loss_coef: float = 0.0  # an MoE policy's load-balancing loss weight, as TRL resolves it (moe.py)
    top_entropy_quantile: float = 1.0  # < 1: TRL's entropy mask on the per-token loss (`iterations.high_entropy_mask`)
    ref_sync: tuple[float, int] | None = None  # sync_ref_model: (ref_model_mixup_alpha, ref_model_sync_steps)
    replica_group: Any = None  # trainer_replica_groups > 1: this job's `replica_group.ReplicaGroup`
    replica_makeup: Any = None  # and its `replica_makeup.ShareMakeup` (the missing shares it samples itself)
    trainer_only: bool = False  # a replica group sharing group 0's generators, not group 0: it has none
    lookahead: bool = False  # sampler_lookahead='adamw': the generator samples with predicted weights (lookahead.py)
    skip_flat_rows: bool = False  # no forward or backward for rows with advantage 0 where exact (`rows_to_train`)
    skip_flat_backward: bool = False  # no backward for rows with advantage 0 where exact (`forward_only_plan`)


class TrainerExecutor(Executor):
    role = "trainer"

    def __init__(self, spec: TrainerSpec, topology: Topology):
        self.spec, self.topology = spec, topology
        self.version = 0  # optimizer steps taken = policy version of the current weights
        self._old_version = 0  # the version of pi_old: the current batch's first pass
        self.sent_version = 0  # the generator starts from the initial weights (version 0)
        self.lookahead_steps = 0  # how far ahead the last sync's weights were moved (`lookahead.sampling_weights`)
        self.inbox: dict[int, list[RolloutGroup]] = {}
        self.eval_inbox: list[RolloutGroup] = []  # evaluations the generator sent (eval_dataset), logged at `step`
        self.backend = None  # the weight-sync backend; `run_job` sets the one its channel uses
        self.weights_channel = None  # set by the front-end; its `last_seconds` is logged
        self.dispatch = None  # `run_job` sets it: who generates what (`hfllamarl.runtime.loop.dispatch`)
        self.group_filter = (GroupFilter(spec.dynamic_sampling_groups, spec.schedule.version_staleness)
                             if spec.dynamic_sampling_groups else None)  # dynamic sampling (drop_zero_variance_groups)
        self.trained_rows: list[list[int]] = []  # dataset rows of each trained batch, in order
        self._save_due = False
        self.startup_profile: dict[str, float] = {}  # where the start-up went (`world.startup`; first rank, step 1)
        self.sync_bytes = 0  # bytes of one weight sync (in the wire dtype), set by `init`
        self.channel_seconds = 0.0  # this tick's time in the channels, before `step`
        self.head_start = None  # `runtime.training.head_start.HeadStart`: sampling in the weights channel, or None
        self.layout = Layout(spec)  # how micro-batches are laid out: padded until `prepare` checks the real model
        self.balancing = (balancing_loss_fn(spec.model)  # (router logits, token mask) -> an MoE's aux loss
                          if spec.router_aux_loss_coef else None)
        self.skips_flat_rows = skips_flat_rows(spec, self.balancing)  # (rows with advantage 0: `rows_to_train`)
        self.skips_flat_backward = skips_flat_backward(spec, self.balancing, self.skips_flat_rows)  # (forward only)
        self._tick_started = time.perf_counter()  # when this tick began (`set_step`): a step's wall time
        self._cpu_started: float | None = None  # this process's CPU time when its last step ended (or its first began)
        self._prepared = self._reported = False
        self.bootstrapping = False  # training on batches it sampled itself (`runtime.training.bootstrap`)
        self.first_tick = 0  # after a bootstrap: the generators' first tick (the batches the trainer sampled)
        self.bootstrapped = 0  # of those, the ones trained already (the last may wait for the loop's first tick)
        self.replica_received = None  # replica groups: the share handed to this group this step (rows, advantages, rewards)

    @property
    def data_offset(self) -> int:
        """Trainer replica groups: the global batch of this job's batch 0 (its generators sample by it)."""
        return self.spec.replica_group.offset if self.spec.replica_group is not None else 0

    @property
    def weights(self):
        """What the weight sync sends: the policy, or for a LoRA policy its merged weights."""
        return self.spec.weights if self.spec.weights is not None else self.spec.model

    def prepare(self) -> None:
        """What training needs before the first step, apart from the generators (a bootstrapping trainer calls it
        before they are up; `init` calls it otherwise)."""
        if self._prepared:
            return
        self._prepared = True
        if self.topology.core_lender is not None:  # a single-process CPU job: borrow the generators' idle cores
            self.topology.core_lender.install(self.spec.model)
        self.layout = Layout.checked(self.spec, self.balancing)  # packed, and prompts shared where it pays

    def init(self) -> None:
        self.backend = self.backend or self.spec.backend
        self.prepare()
        startup.mark("ready")
        wait_for_startup(self.topology, self.spec.startup_timeout_s)
        if self.first_tick:  # (the trainer bootstrapped the batches before it: the generators take over now)
            startup.mark("handover")
        self.backend.setup_trainer(self.weights)
        self.sync_bytes = sum(t.numel() * self.backend.wire_dtype(t.dtype).itemsize
                              for t in self.weights.state_dict().values())

    # ------------------------------------------------------------------ channels
    def get_output(self, channel: str):
        if channel != POLICY_WEIGHTS:
            return super().get_output(channel)
        # New weights go out when there are some and the generator still samples (new batches, or the carried
        # completions of partial rollouts) or evaluates them (an evaluation due by the last step).
        schedule = self.spec.schedule
        if self.version > self.sent_version and (schedule.generator_samples(self.tick)
                                                 or schedule.evaluates(self.version)):
            self.sent_version = self.version
            sent, self.lookahead_steps = sampling_weights(self.spec, self.weights, self.tick, self.version)
            if self.spec.verify_dir is not None:  # verify_weight_sync: what is sent, as vLLM's loader reads it
                export_for_verify(sent, self.spec.verify_dir, self.version, self.topology.rank == 0,
                                  self.backend.wire_dtype)
            return sent, self.version
        return None

    def put_input(self, channel: str, value) -> None:
        if channel != ROLLOUTS:
            return super().put_input(channel, value)
        for group in value or []:
            if group.eval_version is not None:
                self.eval_inbox.append(group)
            else:
                self.inbox.setdefault(group.batch_index, []).append(group)

    # ------------------------------------------------------------------ work
    def set_step(self, tick: int) -> None:
        super().set_step(tick)
        self._tick_started = time.perf_counter()
        if self._cpu_started is None:
            self._cpu_started = time.process_time()

    def step(self) -> None:
        if self.eval_inbox:
            evaluations, self.eval_inbox = self.eval_inbox, []
            for version in sorted({g.eval_version for g in evaluations}):
                self.spec.on_eval(self.evaluation_metrics([g for g in evaluations if g.eval_version == version]))
        batch_index = self.spec.schedule.trainer_batch(self.tick)
        if batch_index is None or batch_index < self.bootstrapped:  # (a bootstrapped batch is trained already)
            return
        # (a bootstrapped batch waited for nothing: the time before this was its own sampling)
        self.channel_seconds = 0.0 if self.bootstrapping else time.perf_counter() - self._tick_started
        if self.head_start is not None:  # (its sampling in the channel is work, logged as time/head_start)
            self.channel_seconds = max(0.0, self.channel_seconds - self.head_start.seconds)
        groups = self.inbox.pop(batch_index, None)
        if not groups and self.spec.trainer_only:
            groups = []  # (a replica group without generators: group 0 hands it its share in the step)
        elif not groups:
            raise RuntimeError(f"trainer: batch {batch_index} never arrived from the generator")
        if self.dispatch is not None:  # in position order, exactly this rank's positions
            groups = self.dispatch.ordered(batch_index, groups)
        startup.mark("first_rollouts")
        lender = self.topology.core_lender
        with lender.lending(self.tick) if lender is not None else contextlib.nullcontext():
            self.train_on(groups)
        startup.mark("first_step")
        if not self.bootstrapping and not self._reported:  # (after a bootstrap: its first generated batch)
            self._reported = True
            self._report_startup()

    def _report_startup(self) -> None:
        """After the first step, the first trainer rank logs where the job's start-up went (`world.startup`)."""
        if self.topology.rank != 0:
            return
        generators = startup.collect(self.topology, self.topology.generator_ranks)
        self.startup_profile = startup.profile(startup.marks(), generators)
        if self.startup_profile and self.first_tick:  # (the batches the trainer sampled itself: `bootstrap`)
            self.startup_profile["bootstrapped_batches"] = float(self.first_tick)
            self.startup_profile["bootstrap_trained_batches"] = float(self.bootstrapped)
        if self.startup_profile:
            logger.info("%s", startup.describe(self.startup_profile))

    def train_on(self, groups: list[RolloutGroup]) -> dict:
        spec = self.spec
        start = time.perf_counter()
        self._check_staleness(groups)
        rollouts = [r for g in groups for r in g.rollouts]  # what the batch generated (its rewards are logged)
        rewards_t0 = time.perf_counter()
        # (no groups: a replica group without generators, handed its share scored)
        rewards, per_func = self._score(rollouts, [len(g.rollouts) for g in groups]) if groups else ([], {})
        reward_seconds = time.perf_counter() - rewards_t0
        logged, extra = spec.rewards.drain(len(rollouts))  # TRL's log_metric / log_extra calls of this step
        trained, trained_rewards, trained_scores, sampling = groups, rewards, per_func, {}
        if self.group_filter is not None:  # dynamic sampling: no flat group, refilled from the reserve
            chosen, sampling = self.group_filter.select(split_scored(groups, rewards, per_func), self.version)
            trained, trained_rewards, trained_scores = join_scored(chosen)
        train_rollouts = [r for g in trained for r in g.rollouts]
        if spec.on_samples is not None:  # log_completions: the step's samples, gathered to the first trainer rank
            logged_advantages = self._advantages(rewards, per_func)
            spec.on_samples(gather_samples(rollouts, per_func, logged_advantages, self.topology.rank == 0, extra))
        advantages = self._advantages(trained_rewards, trained_scores) if train_rollouts else None  # [N]
        staleness = [[self.version - v for v in r.sampled_versions()] for r in train_rollouts]  # per sampled token
        self.trained_rows.append([r.row_index for r in train_rollouts[:: spec.num_generations]])
        batch_index = groups[0].batch_index if groups else 0
        sampled_offset = groups[0].data_offset if groups else self.data_offset  # (replica groups)
        shares = None  # (shared generators: each rollout's share of the global batch, its group's to train)
        if spec.replica_group is not None and spec.replica_group.shared_generators:
            per_share = spec.schedule.prompts_per_batch // spec.replica_group.groups
            shares = [g.position // per_share for g in trained for _ in g.rollouts]
        old: list[torch.Tensor] = []  # pi_old per micro-batch: the first pass's log-probs, detached
        save_due, metrics = False, {}
        for p in range(max(1, spec.schedule.passes(batch_index))):  # each pass: one optimizer step, one version
            passed = self._optimizer_pass(train_rollouts, advantages, old, sampled_offset, shares, trained_rewards)
            if p == 0:  # what the batch generated and scored is logged once, with its first step (TRL: at generation)
                if not groups and self.replica_received is not None:  # (no generators: the share group 0 handed it)
                    rollouts, _, rewards = self.replica_received
                    staleness = [[self.version - 1 - v for v in r.sampled_versions()] for r in rollouts]
                metrics = step_metrics(spec, groups, rollouts, rewards, per_func, staleness, passed.pop("loss"),
                                       passed.pop("stats"))
                if sampling:
                    metrics.update(_all_sum(sampling))
                metrics["reward_seconds"] = reward_seconds
                metrics.update(_logged_means(logged))
                metrics.update(spec.rewards.counters())
                if self.dispatch is not None:
                    metrics.update(self.dispatch.metrics())  # replicas/live, replicas/lost, replicas/regenerated_prompts
                if spec.replica_group is not None:
                    metrics.update(spec.replica_group.metrics())  # replicas/trainer_groups, ...
            else:
                metrics = reduce_metrics({"loss": [passed.pop("loss")], **passed.pop("stats")})
            metrics.update(passed)
            metrics["weight_sync_seconds"] = self.weights_channel.last_seconds if self.weights_channel else 0.0
            metrics["weight_sync/bytes"] = float(self.sync_bytes)  # per sync, all generator ranks get it
            if spec.lookahead:  # the optimizer steps the last sync's weights were moved ahead by
                metrics["weight_sync/lookahead_steps"] = float(self.lookahead_steps)
            metrics["train_step_seconds"] = time.perf_counter() - start
            metrics["step_time"] = time.perf_counter() - self._tick_started  # TRL's name: the step's wall time
            # this process's CPU time since its previous step ended (core-seconds: every thread, borrowed cores too)
            metrics["time/cpu_seconds"] = time.process_time() - (self._cpu_started or time.process_time())
            start = self._tick_started = time.perf_counter()  # the next pass's times start here
            self._cpu_started = time.process_time()
            save_due = bool(spec.on_step(self.version, metrics)) or save_due
        self._save_due = save_due
        return metrics

    def _optimizer_pass(self, rollouts: list[Rollout], advantages: torch.Tensor | None, old: list,
                        sampled_offset: int = 0, shares: list[int] | None = None,
                        rewards: list[float] | None = None) -> dict:
        """One optimizer step over the batch (none when it has nothing to train: the version still advances), then
        the scheduler and, when due, the reference model's sync. Returns the step's loss, per-micro-batch `stats`
        and timings. `old` holds pi_old per micro-batch (filled by the first pass); `sampled_offset`: the replica
        group's data offset the batch was sampled under, `shares` and `rewards` each rollout's share of the global batch
        and its reward (replica groups sharing group 0's generators)."""
        spec = self.spec
        backward_t0 = time.perf_counter()
        loss_total, stats, grad_norm, optimizer_seconds = 0.0, {}, 0.0, 0.0
        if spec.replica_group is not None:  # with the other replica groups: this group's rows, maybe none
            rollouts, (loss_total, stats) = self._replica_gradients(rollouts, advantages, old, sampled_offset,
                                                                    shares, rewards)
        elif rollouts:  # every trainer rank alike (dynamic sampling agrees on the count)
            loss_total, stats = self._accumulate_gradients(rollouts, advantages, old)
        if rollouts:
            grad_norm = self._checked_grad_norm()
            factor = stats.pop("_step_scale", [None])[0]  # a correction's learning-rate factor for this step
            optimizer_t0 = time.perf_counter()
            with scaled_lr(spec.optimizer, factor):
                spec.optimizer.step()
            spec.optimizer.zero_grad(set_to_none=True)
            optimizer_seconds = time.perf_counter() - optimizer_t0
        backward_seconds = time.perf_counter() - backward_t0 - optimizer_seconds
        lr = spec.scheduler.get_last_lr()[0] if spec.scheduler is not None else None  # the rate this step used (TRL's log)
        if spec.scheduler is not None:  # the schedule counts steps, trained or not
            spec.scheduler.step()
        self.version += 1
        if spec.ref_sync is not None and spec.ref_model is not None and self.version % spec.ref_sync[1] == 0:
            mix_reference(spec.model, spec.ref_model, spec.ref_sync[0])  # TRL: on_step_end of every N-th step
        # where the trainer's time went (hfllamarl bench vs-trl --profile): its channels this tick (waiting for the
        # rollouts, sending weights), the forward and backward passes, the optimizer
        out = {"loss": loss_total, "stats": stats, "time/channels": self.channel_seconds,
               "time/forward_backward": backward_seconds, "time/optimizer": optimizer_seconds, "grad_norm": grad_norm}
        self.channel_seconds = 0.0  # the batch's later passes wait for nothing
        if self.head_start is not None:
            out.update(self.head_start.metrics())
        lender = self.topology.core_lender if self.topology is not None else None
        if lender is not None:  # the generators finished first and lent their cores for the rest of this step
            out["time/borrowed_cores"] = float(lender.borrowed)
        if lr is not None:
            out["learning_rate"] = lr
        return out

    def _replica_gradients(self, rollouts: list[Rollout], advantages, old: list, sampled_offset: int,
                           shares: list[int] | None = None,
                           rewards: list[float] | None = None) -> tuple[list[Rollout], tuple]:
        """Trainer replica groups: the step's gradients with the other groups (`replica_step.replica_gradients`)."""
        return replica_gradients(self, rollouts, advantages, old, sampled_offset, shares, rewards)

    def _loss_tokens(self, rollouts: list[Rollout]) -> int:
        """The completion tokens of `rollouts` the loss counts (not the masked truncated ones)."""
        mask = self.spec.mask_truncated_completions
        return sum(r.num_sampled for r in rollouts if not (mask and r.finish_reason == "length"))

    def _check_staleness(self, groups: list[RolloutGroup]) -> None:
        """A token staler than max_staleness means a broken schedule: stop before anything is scored."""
        worst = max((self.version - v for g in groups for r in g.rollouts for v in r.sampled_versions()), default=0)
        schedule = self.spec.schedule
        if worst > schedule.version_staleness:
            per = f" x num_iterations={schedule.iterations}" if schedule.iterations > 1 else ""
            raise RuntimeError(f"trainer: a token of batch {groups[0].batch_index} was sampled {worst} policy versions "
                               f"ago, past max_staleness={schedule.max_staleness}{per}; the schedule is broken")

    def _advantages(self, rewards: list[float], per_func: dict[str, list]) -> torch.Tensor:
        """`[N]` advantages of the combined rewards (NaN: unscored, advantage 0): the algorithm's, or with
        multi_objective_aggregation="normalize_then_sum" TRL's (each function normalised per group, the weighted sum
        normalised over the step). Every trainer rank calls it (scale_rewards="batch" reduces over them)."""
        spec = self.spec
        if spec.rewards.aggregation == "normalize_then_sum":
            names = spec.rewards.names
            scores = torch.tensor([[math.nan if v is None else float(v) for v in per_func[name]] for name in names],
                                  dtype=torch.float32).T.reshape(len(rewards), len(names))
            return normalize_then_sum_advantages(scores, spec.rewards.weights, spec.num_generations)
        advantages = spec.algorithm.advantages(torch.tensor(rewards, dtype=torch.float32), spec.num_generations)
        return torch.nan_to_num(advantages, nan=0.0)  # as TRL: an unscored completion moves nothing

    def _score(self, rollouts: list[Rollout], group_sizes: list[int]) -> tuple[list[float], dict]:
        """Every rollout's combined reward (an unscored one: NaN, as TRL) and each reward function's scores
        (TRL's call)."""
        return shared_rewards.score(self.spec, rollouts, group_sizes)  # (once per tensor-parallel group)

    def _checked_grad_norm(self) -> float:
        """The gradients' norm (clipped to max_grad_norm); a NaN/inf one stops the step before the optimizer."""
        model = self.spec.model
        reduce_partial_gradients(model)  # (trainer tensor parallelism: whole parameters used on sharded heads)
        grad_norm = total_grad_norm(model, self.spec.max_grad_norm)
        if not math.isfinite(grad_norm):  # no optimizer step with a NaN/inf gradient: the weights stay finite
            bad = first_bad_gradient(model)
            where = self.topology.describe(self.topology.rank)
            agree([f"the gradient norm is {grad_norm}; {bad}"] if bad else [], step=self.version + 1, rank_name=where)
            raise NonFiniteError(f"non-finite values at step {self.version + 1}: the gradient norm is {grad_norm} while "
                                 "every gradient is finite (it overflowed). The step was stopped before the optimizer; "
                                 "lower the learning rate or clip gradients (max_grad_norm).")
        return grad_norm

    def _accumulate_gradients(self, rollouts: list[Rollout], advantages: torch.Tensor, old: list | None = None,
                              step_tokens: float | None = None, groups: int = 1) -> tuple[float, dict]:
        """Forward and backward over micro-batches (gradients summed, reduced once at the last one).

        `old`: pi_old per micro-batch; an empty list (the batch's first pass) is filled with this pass's log-probs,
        detached, which later passes give the algorithm as `old_logprobs` (when its loss names it). With
        top_entropy_quantile < 1 the algorithm also gets TRL's `entropy_mask`.

        Returns the step's loss and, per metric the algorithm's loss returns (and `is_ratio/outside_support_frac`),
        one value per micro-batch.
        """
        old = [] if old is None else old
        if not old:
            self._old_version = self.version  # pi_old's version: the batch's first pass
        spec, model = self.spec, self.spec.model
        mb = spec.micro_batch_size
        tokens = _all_sum({"tokens": self._loss_tokens(rollouts)})["tokens"] if step_tokens is None else step_tokens
        keep = rows_to_train(advantages, self.skips_flat_rows)  # (the step's tokens count the skipped rows too)
        skipped = 1.0 - len(keep) / max(len(rollouts), 1)
        rollouts, advantages = [rollouts[i] for i in keep], advantages[keep]
        plan = forward_only_plan(advantages, mb, self.skips_flat_backward)  # (rows with advantage 0: forward only)
        steps = len(plan)
        last_backward = max((k for k, (grad, _, _) in enumerate(plan) if grad), default=-1)
        masked = [spec.mask_truncated_completions and r.finish_reason == "length" for r in rollouts]
        shape = StepShape(tokens=tokens, trainer_ranks=data_world_size() * groups,  # (groups: replica groups)
                          micro_batches=steps, max_completion_length=spec.max_completion_length)
        takes = loss_keywords(spec.algorithm)
        extra = {"shape": shape} if "shape" in takes else {}
        stats: dict[str, list[float]] = {}
        loss_total = 0.0
        step_weights = [] if scales_steps(spec.algorithm) else None  # log(pi_old/mu) per sequence (`step_scale`)
        for k in range(steps):
            chunk = rollouts[k * mb:(k + 1) * mb]
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(k == last_backward)  # reduce-scatter once per optimizer step
            routers = [] if self.balancing else None
            batch, raw, entropy = self._forward(chunk, plan[k], k * mb, routers)
            if any(masked[k * mb:(k + 1) * mb]):  # TRL's mask_truncated_completions: no loss on them
                keep = torch.tensor([not m for m in masked[k * mb:(k + 1) * mb]], device=spec.device)
                batch["mask"] = batch["mask"] * keep[:, None]
            logprobs, outside = within_support(raw, batch["mask"], spec.sampling)
            chunk_advantages = advantages[k * mb:(k + 1) * mb].to(spec.device)
            ref = None
            if spec.ref_model is not None:
                with torch.no_grad():
                    ref, ref_outside = within_support(completion_logprobs(spec.ref_model, batch, spec.sampling),
                                                      batch["mask"], spec.sampling)
                    ref = torch.where(outside | ref_outside, logprobs.detach(), ref)  # KL only where both can sample
            kwargs = dict(extra, **({"ref_logprobs": ref} if ref is not None else {}))
            if len(old) == k:  # the batch's first pass: this is pi_old
                old.append(logprobs.detach())
            if "old_logprobs" in takes:
                kwargs["old_logprobs"] = old[k]
            if "staleness" in takes:
                kwargs["staleness"] = token_staleness(chunk, self._old_version, batch["mask"].shape, spec.device)
            if step_weights is not None:
                step_weights.append(sequence_log_weights(old[k], batch["behavior_logprobs"], batch["mask"]))
            if spec.top_entropy_quantile < 1.0 and "entropy_mask" in takes:
                kwargs["entropy_mask"] = high_entropy_mask(entropy, batch["mask"], spec.top_entropy_quantile)
            loss, m = checked_loss(spec.algorithm, spec.algorithm.loss(logprobs, batch["behavior_logprobs"],
                                                                       chunk_advantages, batch["mask"], **kwargs),
                                   with_grad=bool(plan[k][0]))
            if routers is not None:  # TRL's MoE load-balancing loss over the micro-batch's tokens, weighted
                aux = self.balancing(routers, batch["token_mask"])
                loss = loss + spec.router_aux_loss_coef * aux
                m["aux_loss"] = float(aux.detach())
            m["is_ratio/outside_support_frac"] = float(outside.sum()) / max(float(batch["mask"].sum()), 1.0)
            m["entropy"] = float((entropy * batch["mask"]).sum()) / max(float(batch["mask"].sum()), 1.0)
            m["shared_prompts/tokens_saved_frac"] = batch["tokens_saved_frac"]
            # Every rank agrees before the backward pass (whose collectives would wait on a rank that stopped).
            agree(nonfinite_problems(batch, raw.masked_fill(outside, 0.0), chunk_advantages, loss, chunk, k * mb),
                  step=self.version + 1, rank_name=self.topology.describe(self.topology.rank))
            if plan[k][0]:  # (a micro-batch of flat rows only ran forward: it adds nothing to the gradient)
                (loss / steps).backward()
            loss_total += loss.item() / steps
            for key, value in m.items():
                stats.setdefault(key, []).append(value)
        if last_backward < steps - 1 and hasattr(model, "reshard"):  # a pass without gradient ran last: FSDP2 left
            model.reshard()  # the root's parameters gathered (registered without their gradients) until told
        if step_weights is not None:  # the learning-rate factor of this step ("_step_scale") and its metrics
            stats.update(step_scale(spec.algorithm, step_weights))
        stats["trainer/flat_rows_skipped_frac"] = [skipped]
        stats["trainer/flat_rows_forward_only_frac"] = [sum(len(rest) for _, rest, _ in plan) / max(len(keep), 1)]
        return loss_total, stats

    def _forward(self, chunk: list[Rollout], plan: tuple[list[int], list[int], bool], offset: int,
                 routers: list | None) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """One micro-batch's inputs and loss side, log pi and entropy (`completion_logprobs`). Under a plan with
        forward-only rows (`forward_only_plan`; indices from `offset`), those run in a pass of their own without
        gradient, and both passes' `[b, t]` outputs are put back in the micro-batch's row order, so the loss and its
        metrics see the whole micro-batch as in one pass (to rounding: the passes pack their rows apart)."""
        spec, model = self.spec, self.spec.model
        grad, rest, spare = [i - offset for i in plan[0]], [i - offset for i in plan[1]], plan[2]
        if not rest and not spare:
            batch = self.layout.build(chunk)
            raw, entropy = completion_logprobs(model, batch, spec.sampling, entropy=True, router_logits=routers)
            return batch, raw, entropy
        parts, computed = [], 0.0
        for rows, with_grad in ((rest or grad[:1], False), (grad, True)):  # (the pass without gradient first)
            if not rows:
                continue
            built = self.layout.build([chunk[i] for i in rows])
            with contextlib.nullcontext() if with_grad else torch.no_grad():
                out = completion_logprobs(model, built, spec.sampling, entropy=True,
                                          router_logits=routers if with_grad else None)
            if with_grad or not spare:  # (a spare pass ran for the other ranks only: its result is dropped)
                parts.append(out)
                computed += float(built["token_mask"].sum())
        batch = {key: (value.to(spec.device) if torch.is_tensor(value) else value)
                 for key, value in loss_side(chunk, spec.pad_token_id).items()}
        order = rest + grad  # the kept passes' rows, in turn (a spare pass has no rows of `rest`)
        where = torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=spec.device)
        T = batch["mask"].shape[1]
        raw, entropy = (torch.cat([F.pad(part[j], (0, T - part[j].shape[1])) for part in parts]).index_select(0, where)
                        for j in (0, 1))
        separate = sum(len(r.prompt_ids) + len(r.completion_ids) for r in chunk)
        batch["tokens_saved_frac"] = 1.0 - computed / max(separate, 1)
        return batch, raw, entropy

    def evaluation_metrics(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """The eval_* metrics of one evaluation (`hfllamarl.runtime.training.rank_metrics.evaluation_metrics`)."""
        return evaluation_metrics(self.spec, groups)

    def close(self) -> None:
        if self.topology.core_lender is not None:
            self.topology.core_lender.close()
        if self.spec.verify_dir is not None and self.topology.rank == 0:
            import shutil

            shutil.rmtree(os.path.dirname(self.spec.verify_dir(0)), ignore_errors=True)

    def checkpoint_due(self) -> bool:
        due, self._save_due = self._save_due, False
        return due

    def stop_requested(self) -> bool:
        """Whether a callback on any trainer rank asked to end the run after the last step (transformers' Trainer
        stops there); the trainer ranks agree, then the weights channel tells the generator ranks."""
        group = self.spec.replica_group  # (replica groups: the run ends at the global step count)
        done = group is not None and group.global_step >= self.spec.schedule.num_steps
        return _all_max([1.0 if self.spec.should_stop() or done else 0.0])[0] > 0

    def save_checkpoint(self) -> None:
        self.spec.save_checkpoint(self.version)


def checked_loss(algorithm, out, with_grad: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """What `Algorithm.loss` returned, checked against the contract: a scalar tensor with gradient (`with_grad`: its
    inputs had one; a micro-batch of flat rows run forward only has none) and a dict of numbers by metric name. A
    plugin that breaks it is named, before anything is logged or stepped."""
    name = type(algorithm).__name__
    contract = "Algorithm.loss must return (a scalar loss tensor with gradient, {metric name: number})"
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"the algorithm {name} returned {type(out).__name__} from loss(); {contract}.")
    loss, metrics = out
    if not (torch.is_tensor(loss) and loss.numel() == 1 and (loss.requires_grad or not with_grad)):
        what = f"a tensor of shape {tuple(loss.shape)}" + ("" if loss.requires_grad else " without gradient") \
            if torch.is_tensor(loss) else type(loss).__name__
        raise TypeError(f"the algorithm {name} returned {what} as its loss; {contract}.")
    if not isinstance(metrics, dict):
        raise TypeError(f"the algorithm {name} returned {type(metrics).__name__} as its metrics; {contract}.")
    clean = {}
    for key, value in metrics.items():
        try:
            clean[str(key)] = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"the algorithm {name} returned metric {key!r} = {value!r}; {contract}.") from None
    return loss.reshape(()), clean
