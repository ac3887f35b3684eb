"""`AsyncAIPOConfig`: TRL's `GRPOConfig` plus the settings of an asynchronous LlamaRL job.

Every `GRPOConfig` field keeps its name and meaning. Fields that describe something this
runtime does differently (a vLLM server, transformers' own generation) are rejected with an explanation when set, never silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

from trl import GRPOConfig

from hfllamarl.runtime.loop.sampling import NEUTRAL_KWARGS, Sampling

from . import trainer_layout
from .config_fields import UNSUPPORTED as _UNSUPPORTED
from .config_fields import remember_written_fields, warn_written_use_vllm, written_fields
from .sampling_fields import check_sampling
from .schedule_fields import check_head_start, check_partial_rollouts, check_sampler_lookahead
from .tool_budget import check_tool_tick, default_tool_budget

# vLLM quantization methods that quantize full-precision weights on load (so also at every weight sync).
_ONLINE_QUANTIZATION = {"fp8": "vLLM's fp8 kernels, compute capability 8.9+, e.g. H100 or L40S"}


@remember_written_fields
@dataclass
class AsyncAIPOConfig(GRPOConfig):
    """Configuration of an asynchronous AIPO job (all `GRPOConfig` fields, plus the ones below).

    A generation batch (one optimizer step) is `per_device_train_batch_size x (number of data-parallel
    trainer ranks: the trainer ranks / trainer_tensor_parallel_size) x gradient_accumulation_steps`
    completions, `num_generations` per prompt; the completions of one prompt always land on the same
    trainer rank (tensor-parallel group).
    """

    num_generator_processes: int = field(
        default=1,
        metadata={"help": "How many processes run vLLM; the other processes train. They form num_generator_processes / "
                  "generator_tensor_parallel_size independent vLLM engines (replicas), each tensor parallel over "
                  "generator_tensor_parallel_size consecutive ranks. In a single-process run (`python script.py`) the "
                  "generators are started as child processes."},
    )
    generator_tensor_parallel_size: int | None = field(
        default=None,
        metadata={"help": "Tensor-parallel size of each vLLM replica (default: `vllm_tensor_parallel_size` if set, "
                  "else num_generator_processes / vllm_data_parallel_size: with neither, one engine over all "
                  "generator processes)."},
    )
    trainer_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Tensor-parallel size of the trainer ranks: consecutive groups of this many trainer processes "
                  "split each decoder layer (attention heads, MLP columns) and the output layer's vocabulary between "
                  "them, and FSDP2 shards over the groups (a 2-D mesh, data parallel x tensor parallel). A batch is "
                  "split over the groups, not the processes. Needs a launcher (torchrun / accelerate launch) with at "
                  "least this many trainer processes; refused for mixtures of experts, LoRA, and models whose heads "
                  "or MLP width it does not divide."},
    )
    trainer_fsdp_shard_size: int | None = field(
        default=None,
        metadata={"help": "FSDP2 shards each parameter over groups of this many consecutive data-parallel trainer "
                  "ranks (the trainer processes / trainer_tensor_parallel_size), and the groups hold replicas (hybrid "
                  "sharding, HSDP: gradients reduce-scattered inside a group, all-reduced across groups). Default: "
                  "every data-parallel rank, one group. `hfllamarl plan` names the size it plans."},
    )
    trainer_replica_groups: int = field(
        default=1,
        metadata={"help": "Trainer replica groups that survive one another (torchft, docs/design/elastic.md): this "
                  "many jobs, each launched on its own with its own trainer and generator processes, train one "
                  "policy; each trains its share of every batch (prompts_per_generation prompts), their gradients "
                  "are averaged per step, and a group that dies or freezes is left out while the others train on. A "
                  "restarted group copies the weights and optimizer state from a live one. Needs torchft_lighthouse."},
    )
    trainer_replica_group: int = field(
        default=0,
        metadata={"help": "With trainer_replica_groups > 1: this job's group, 0 .. trainer_replica_groups - 1 (the "
                  "same after a restart)."},
    )
    trainer_replica_shared_generators: bool = field(
        default=False,
        metadata={"help": "With trainer_replica_groups > 1: the groups share group 0's generators instead of each "
                  "running its own. Group 0's generators sample every group's share of each global batch, group 0's "
                  "trainer scores them and hands each group its share in the step (over the groups' torchft group); "
                  "the other groups start no generator and train what they are handed. A group that is away: group 0 "
                  "trains its share; group 0 away: the others sample their shares on their trainers until it is "
                  "back. Each group one trainer process (docs/design/elastic.md, 'A shared generator pool')."},
    )
    torchft_lighthouse: str | None = field(
        default=None,
        metadata={"help": "With trainer_replica_groups > 1: the address of the torchft lighthouse every group joins "
                  "(`torchft_lighthouse --min_replicas 1 ...` prints it; default: $TORCHFT_LIGHTHOUSE)."},
    )
    trainer_sequence_parallel: bool = field(
        default=False,
        metadata={"help": "With trainer_tensor_parallel_size > 1: split the residual stream and the norms between "
                  "the attention and MLP blocks by sequence position inside each tensor-parallel group (Megatron's "
                  "sequence parallelism). The same communication volume; activation memory outside the blocks / the "
                  "group size, which pays for long sequences. Batches are padded to a multiple of the group size."},
    )
    vllm_data_parallel_size: int | None = field(
        default=None,
        metadata={"help": "The number of vLLM replicas (data parallel), as `trl vllm-serve --data_parallel_size`: "
                  "must equal num_generator_processes / generator_tensor_parallel_size when both are set."},
    )
    generator_failure: str = field(
        default="stop",
        metadata={"help": "What the loss of a generator replica (its process died, froze or raised) does: 'stop' ends "
                  "the job naming it; 'continue' goes on with the other replicas: they take its prompts (the ones it "
                  "had not delivered are generated again), the next weight syncs skip it, the loss is logged and "
                  "counted (replicas/lost). The job stops when no replica is left. Trainer failures always stop it."},
    )
    max_staleness: int = field(
        default=1,
        metadata={"help": "How many policy versions the generator may run ahead of the trainer. 0 is strictly "
                  "on-policy (generation and training alternate: the synchronous baseline)."},
    )
    partial_rollout_tokens: int | None = field(
        default=None,
        metadata={"help": "Partial rollouts: the per-tick generation budget of one completion, in tokens. A completion "
                  "that has neither stopped nor reached max_completion_length after that many tokens is carried to the "
                  "next tick and continued under the newer weights; every token keeps the log-prob and policy version "
                  "it was sampled under. A batch then spans up to ceil(max_completion_length / partial_rollout_tokens) "
                  "ticks, which must not exceed max_staleness. None: every completion is generated in one tick."},
    )
    sampler_lookahead: str = field(
        default="none",
        metadata={"help": "What the generator samples with while the trainer is max_staleness steps ahead of it: "
                  "'none' (the trainer's newest weights) or 'adamw' (those weights moved one step ahead along AdamW's "
                  "own momentum: about the policy that trains on the batch at max_staleness=1; the log-probs of what "
                  "was sampled are recorded as mu, so the loss's correction stays exact). 'adamw' learns more per step "
                  "where each step moves the policy far, but lost one run in twenty on the staleness study's task "
                  "(docs: Learning under staleness). Not with LoRA or partial rollouts; evaluations get the weights "
                  "as they are."},
    )
    bootstrap_generation: bool = field(
        default=True,
        metadata={"help": "A single-process job (python script.py, a notebook): while the generator process starts "
                  "(imports vLLM, builds its engine) the trainer samples the first batches itself with transformers, "
                  "on-policy, and trains on them; the generator takes over at the next batch once its engine is up. "
                  "Not used (logged why) under a launcher, on a resume, with generator_failure='continue', tools / "
                  "environments / rollout_func, reward models, partial rollouts, dynamic sampling, penalties, "
                  "generation_kwargs or eval_on_start; "
                  "never for a checkpointed or evaluated step, nor the last batch. False: the trainer waits."},
    )
    trainer_head_start: str = field(
        default="auto",
        metadata={"help": "A single-process job on a CPU: while the trainer waits for the generator's batch it samples "
                  "the first tokens of every completion of the generator's next batch (with the policy version it "
                  "sends next, as bootstrapping samples) and the generator goes on from them. 'auto': until the "
                  "generator has finished its tick; a number N: exactly N tokens each tick (reproducible); 'off'. "
                  "Not used (logged why) under a launcher, with more than one generator process, with tools / "
                  "environments / rollout_func, reward models, penalties or generation_kwargs, nor with partial "
                  "rollouts, dynamic sampling, a sampler lookahead or max_staleness=0."},
    )
    aipo_rho: float = field(
        default=4.0,
        metadata={"help": "AIPO clips the per-token importance ratio pi/mu from above at rho (paper: 2..10)."},
    )
    algorithm: str = field(
        default="aipo",
        metadata={"help": "Name of the algorithm plugin (entry point group `hfllamarl.algorithms`)."},
    )
    off_policy_correction: str = field(
        default="auto",
        metadata={"help": "How the loss corrects for tokens sampled by an older policy: a correction plugin (group "
                  "`hfllamarl.corrections`: aipo, token_truncate, token_mask, sequence_truncate, sequence_mask, "
                  "decoupled, a3po, m2po, ess, coupled; options may follow the name, 'a3po:lag=4'; '<name>+ess' adds "
                  "VCPO's step rule, '<name>+trust' the trust-region mask), 'trl' (the vllm_importance_sampling_* fields' correction; "
                  "aipo_rho's truncation for algorithm='aipo'), or 'none'. 'auto': 'trl' when those fields or "
                  "aipo_rho are set or max_staleness is 0, else the loss's default under staleness, chosen by the "
                  "staleness study (docs: Learning under staleness). Taken by the aipo, grpo and rloo algorithms."},
    )
    off_policy_correction_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Options of the named off_policy_correction (e.g. {\"tau\": 0.04} for m2po, {\"cap\": "
                  "5.0} for decoupled), as its class takes them."},
    )
    weight_sync_backend: str = field(
        default="nccl_ddma",
        metadata={"help": "Name of the weight-sync plugin (entry point group `hfllamarl.weight_sync`): "
                  "'nccl_ddma' (every trainer rank sends its own shard to the generators), 'broadcast' (gather on "
                  "trainer rank 0, then send), 'disk' (safetensors files)."},
    )
    collective_timeout_s: float = field(
        default=1800.0,
        metadata={"help": "Seconds any collective or channel operation may wait before the job fails. It must "
                  "cover the longest step of the other side (generation or training)."},
    )
    generator_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of the vLLM engine ('auto': the trainer's parameter dtype; or 'float32', "
                  "'bfloat16', ...). A generator dtype other than the trainer's makes mu differ from pi; AIPO's "
                  "importance weight corrects for it."},
    )
    generator_quantization: str | None = field(
        default=None,
        metadata={"help": "vLLM quantization of the generator ranks only: 'fp8' quantizes the weights the trainer "
                  "sends (bf16) on the fly at every weight sync; the trainer keeps training in bf16, and AIPO's "
                  "importance weight corrects the difference between mu and pi. Needs CUDA GPUs with fp8 support."},
    )
    generator_kv_cache_bytes: int | None = field(
        default=None,
        metadata={"help": "KV-cache size of the vLLM engine in bytes (CPU default: 256 MiB)."},
    )
    generator_enforce_eager: bool = field(
        default=True, metadata={"help": "Run vLLM without CUDA graphs / compilation."},
    )
    lora_sync: str = field(
        default="auto",
        metadata={"help": "With LoRA, what a weight sync sends: 'adapter' (the adapters alone; the generator's vLLM "
                  "engine keeps the base weights and applies them with its LoRA support), 'merged' (every adapted "
                  "layer merged, under the model's own names), or 'auto' (on GPUs, adapters when the engine can apply "
                  "them: fresh adapters on linear layers of a family checked here; otherwise, and on the CPU where "
                  "vLLM's LoRA kernels are slow, merged; the log says why)."},
    )
    verify_weight_sync: bool = field(
        default=False,
        metadata={"help": "Debug: after every weight sync, each generator rank reloads the same weights from files the "
                  "trainer writes (under output_dir, which both sides must see) with vLLM's own loader and compares "
                  "every engine parameter bitwise; the job stops naming the first parameters that differ. Costs a full "
                  "export and reload per sync."},
    )
    drop_zero_variance_groups: bool = field(
        default=False,
        metadata={"help": "Dynamic sampling (DAPO): a group whose rewards are all equal (its advantage is 0) is not "
                  "trained; the step is refilled with groups that have a signal, from the extra prompts the generator "
                  "samples (dynamic_sampling_extra_prompts) and from those left over from earlier batches while they "
                  "stay within max_staleness. Logged as dynamic_sampling/*."},
    )
    dynamic_sampling_extra_prompts: int = field(
        default=0,
        metadata={"help": "With drop_zero_variance_groups: prompts the generator samples per step beyond those the "
                  "step trains (the next ones in the data order), to replace the groups dropped. A multiple of the "
                  "number of trainer processes."},
    )
    padding_free: bool = field(
        default=True,
        metadata={"help": "Pack each micro-batch's sequences (prompt + completion) end to end in rows as wide as the "
                  "longest one, instead of padding every sequence to it (TRL's SFTConfig name). The model's attention "
                  "must keep packed sequences apart by their position ids, as transformers' models do; this is "
                  "checked once on the model, and one that does not trains padded (logged)."},
    )
    share_prompts: bool = field(
        default=True,
        metadata={"help": "With padding_free: compute each group's shared prompt once in the trainer's forward and "
                  "backward pass, its completions after it in one packed run (a 4-D attention mask), where a cost "
                  "estimate from the model's shapes says the prompt tokens saved outweigh the wider rows (long prompts). "
                  "The log-probs are the separate sequences'; checked once on the model. Off with an attention "
                  "implementation that takes no 4-D mask (flash/flex attention), the MoE load-balancing loss and "
                  "sequence parallelism. Logged as shared_prompts/tokens_saved_frac."},
    )
    skip_flat_rows: bool = field(
        default=False,
        metadata={"help": "Run no forward or backward for rows whose advantage is 0 (groups whose rewards are all "
                  "equal): the loss and gradient are unchanged (the step's tokens still count them), the per-token "
                  "metrics (entropy, clip ratios) are then over the rows run. Needs a loss that keeps rows apart "
                  "(dapo or cispo, beta 0, a row-wise correction), top_entropy_quantile 1 and no MoE balancing loss. "
                  "Logged as trainer/flat_rows_skipped_frac."},
    )
    skip_flat_backward: bool = field(
        default=True,
        metadata={"help": "Run only the forward pass for rows whose advantage is 0 (groups whose rewards are all "
                  "equal), no backward: they add nothing to the gradient, and their log-probs still enter the loss "
                  "and its metrics, so the step and its metrics are the whole batch's (to rounding: those rows run "
                  "in a pass of their own). Applies where no gradient flows through such a row: beta 0 and no MoE "
                  "balancing loss (otherwise every row runs both passes). Logged as "
                  "trainer/flat_rows_forward_only_frac."},
    )
    scale_rewards: str = field(
        default="none",
        metadata={"help": "Advantage scaling, as in GRPOConfig, but defaulting to 'none': AIPO's advantage is "
                  "r - mean(r of the group) (paper, section 5). 'group' or 'batch' divide by the std."},
    )
    tool_call_timeout_s: float = field(
        default=60.0,
        metadata={"help": "The longest one tool call (or an environment's get_reward) may run, in seconds. A call "
                  "still running then is abandoned and the model reads an error as its result; the rollout goes on. "
                  "A get_reward still running then leaves its rollout unscored by it (None, as TRL's NaN), whatever "
                  "reward_errors says."},
    )
    max_tool_calls_per_turn: int = field(
        default=8,
        metadata={"help": "The most tool calls one assistant turn may make. A turn that asks for more runs none of them "
                  "and ends its rollout there, as TRL ends one at max_tool_calling_iterations: that turn is the "
                  "completion's last message and the reward functions score it as usual. Counted in "
                  "tools/calls_refused and tools/ended_by_budget."},
    )
    rollout_time_budget_s: float | None = field(
        default=None,
        metadata={"help": "Wall-clock seconds the tool calls of one rollout may take in all, over all its turns. No "
                  "call starts past it and the call running then is abandoned; the rollout ends at the turn that "
                  "made them, as with max_tool_calls_per_turn (the turn's results are dropped). None: half of "
                  "collective_timeout_s (a quarter when evaluations run: they share the generator's tick) less "
                  "tool_call_timeout_s + 1 s for the environments' get_reward calls, so that tools and get_reward "
                  "never take more than half of it per tick; a larger value is refused."},
    )
    reward_errors: str = field(
        default="raise",
        metadata={"help": "What a reward function that raises does: 'raise' stops the job with an error naming "
                  "the function; 'zero' scores that batch 0 for the function, counts it and goes on."},
    )

    def __post_init__(self):
        changed = {f.name for f in fields(GRPOConfig) if f.name in _UNSUPPORTED and _differs(self, f)}
        batch_fields = changed & {"steps_per_generation", "generation_batch_size"}  # checked once the world is known
        self._check_own_fields(changed - batch_fields)
        # On a machine without a GPU, train on the CPU as TRL users do with `use_cpu=True`.
        if not self.use_cpu:
            import torch

            if not torch.cuda.is_available():
                self.use_cpu = True
        if self.bf16 is None and self.use_cpu:
            self.bf16 = False  # TRL defaults to bf16; fp32 keeps pi == mu exact (bf16=True is faster on bf16 CPUs)
        self._check_quantization()
        self._check_training_loop()
        warn_written_use_vllm(self)
        # The launcher's processes must be split into a trainer world and a generator world
        # before TrainingArguments sets up the distributed state (it does so in __post_init__).
        from hfllamarl.runtime.world.topology import init_topology

        self._topology = init_topology(
            num_generator_processes=0 if self.trainer_only else self.num_generator_processes,
            timeout_s=self.collective_timeout_s,
            use_cpu=self.use_cpu,
            tensor_parallel_size=self.generator_tensor_parallel_size,
            failure=self.generator_failure,
            trainer_tp=self._check_trainer_tp(),
        )
        self._check_trainer_layout()
        self._check_generation_batch(batch_fields)
        super().__post_init__()
        self._check_dynamic_sampling()  # needs the topology (the trainer processes)
        self._check_tool_budget()  # needs collective_timeout_s as set (ddp_timeout) and the eval strategy
        try:  # a value the algorithm refuses (an unknown loss_type, ...) fails now, with TRL's aliases applied
            algorithm = self.build_algorithm()
        except ValueError as exc:
            raise ValueError(f"AsyncAIPOConfig: algorithm {self.algorithm!r}: {exc}") from None
        from .iterations import check_iteration_fields

        check_iteration_fields(self, algorithm)  # num_iterations, top_entropy_quantile, sync_ref_model
        from .replica_groups import check_replica_groups

        check_replica_groups(self, algorithm)  # trainer_replica_groups: what a group can and cannot do yet

    def _check_tool_budget(self) -> None:
        """Bound the tool work of one generator tick to `TOOL_SHARE` of collective_timeout_s (see `tool_tick_bound`)."""
        cap, budget = self.max_tool_calls_per_turn, self.rollout_time_budget_s
        if not _is_whole(cap) or cap < 1:
            raise ValueError(f"AsyncAIPOConfig: max_tool_calls_per_turn={cap!r}; it must be a whole number >= 1 (to "
                             "allow no tool call at all, set max_tool_calling_iterations=0).")
        if budget is None:
            self.rollout_time_budget_s = default_tool_budget(self)
            return
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (math.isfinite(budget) and budget > 0):
            raise ValueError(f"AsyncAIPOConfig: rollout_time_budget_s={budget!r}; it must be a number of seconds > 0, "
                             "or None (derived from collective_timeout_s).")
        check_tool_tick(self, get_reward=False)

    def _check_generation_batch(self, set_fields: set[str]) -> None:
        """steps_per_generation / generation_batch_size set to what they mean here anyway (TRL derives the same
        values from gradient_accumulation_steps) are accepted; any other value is refused."""
        accumulation = self.gradient_accumulation_steps
        meaning = {"steps_per_generation": accumulation,
                   "generation_batch_size": self.per_device_train_batch_size * self.num_data_parallel_trainers * accumulation}
        for name in sorted(set_fields):
            if getattr(self, name) != meaning[name]:
                raise ValueError(f"AsyncAIPOConfig: `{name}`={getattr(self, name)}, but {_UNSUPPORTED[name]} "
                                 f"({meaning[name]} here). Remove it.")

    def _check_training_loop(self) -> None:
        """The optimizer, scheduler and timeout fields the trainer ranks read, checked now rather than at step 1."""
        optim = str(getattr(self.optim, "value", self.optim))
        if optim not in ("adamw_torch", "adamw_torch_fused"):
            raise ValueError(f"AsyncAIPOConfig: optim={optim!r} is not supported: the trainer ranks build torch's "
                             "AdamW over the FSDP2 shards (optim='adamw_torch' or 'adamw_torch_fused').")
        lr = self.learning_rate
        if not (isinstance(lr, int | float) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"AsyncAIPOConfig: learning_rate={lr!r}: it must be a finite number >= 0 "
                             "(a negative rate climbs the loss).")
        scheduler = str(getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type))
        if scheduler == "reduce_lr_on_plateau":
            raise ValueError("AsyncAIPOConfig: lr_scheduler_type='reduce_lr_on_plateau' steps on an evaluation "
                             "metric, which the trainer ranks do not have at each step; use another scheduler.")
        if self.ddp_backend is not None and self.ddp_backend != ("gloo" if self.use_cpu else "nccl"):
            raise ValueError(f"AsyncAIPOConfig: ddp_backend={self.ddp_backend!r} is not supported: the ranks talk over "
                             f"{'gloo (CPU)' if self.use_cpu else 'nccl (GPU)'}. Remove it.")
        if self.ddp_timeout != 1800 and self.collective_timeout_s == 1800.0:
            self.collective_timeout_s = float(self.ddp_timeout)  # TrainingArguments' name for the same bound

    def _check_own_fields(self, changed: set[str]) -> None:
        for name in sorted(changed):
            if name in _UNSUPPORTED:
                raise ValueError(f"AsyncAIPOConfig: `{name}` is set, but {_UNSUPPORTED[name]}. Remove it.")
        self._check_replicas()
        if self.max_staleness < 0:
            raise ValueError("AsyncAIPOConfig: max_staleness must be >= 0 (0 = strictly on-policy).")
        from hfllamarl.runtime.data.rewards import AGGREGATIONS

        if self.multi_objective_aggregation not in AGGREGATIONS:
            raise ValueError(f"AsyncAIPOConfig: multi_objective_aggregation={self.multi_objective_aggregation!r}; "
                             f"choose one of {', '.join(map(repr, AGGREGATIONS))}.")
        check_partial_rollouts(self)
        check_sampler_lookahead(self)
        check_head_start(self)
        check_sampling(self)
        if not (math.isfinite(self.aipo_rho) and self.aipo_rho >= 1.0):
            raise ValueError(
                f"AsyncAIPOConfig: aipo_rho={self.aipo_rho}; it must be >= 1 (a lower clip would down-weight "
                "on-policy tokens). The paper uses 2..10."
            )
        if self.num_generations < 2:
            raise ValueError(
                "AsyncAIPOConfig: num_generations must be >= 2: the advantage is the reward minus the mean "
                "reward of the prompt's group."
            )
        per_rank = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if per_rank % self.num_generations:
            raise ValueError(
                f"AsyncAIPOConfig: per_device_train_batch_size x gradient_accumulation_steps ({per_rank}) must be a "
                f"multiple of num_generations ({self.num_generations}): each trainer rank trains whole groups."
            )
        if not (math.isfinite(self.beta) and self.beta >= 0.0):
            raise ValueError(f"AsyncAIPOConfig: beta={self.beta}; the KL coefficient must be >= 0 (0: no reference model).")
        self.algorithm_options  # an unknown algorithm, or an option it does not take, is refused now
        from hfllamarl.registry import load_plugin

        load_plugin("weight_sync", self.weight_sync_backend)  # an unknown name fails now, not mid-run
        if self.reward_errors not in ("raise", "zero"):
            raise ValueError(f"AsyncAIPOConfig: reward_errors must be 'raise' or 'zero', not {self.reward_errors!r}.")
        if self.collective_timeout_s <= 0:
            raise ValueError("AsyncAIPOConfig: collective_timeout_s must be > 0.")
        if not (isinstance(self.tool_call_timeout_s, (int, float)) and self.tool_call_timeout_s > 0):
            raise ValueError(f"AsyncAIPOConfig: tool_call_timeout_s={self.tool_call_timeout_s!r}; it must be > 0 "
                             "(seconds one tool call may run).")
        if self.vllm_server_timeout <= 0:
            raise ValueError("AsyncAIPOConfig: vllm_server_timeout (how long the ranks wait for each other's "
                             "start-up: the policy loaded, the vLLM engine up) must be > 0.")
        if str(getattr(self.save_strategy, "value", self.save_strategy)) == "best":
            raise ValueError(
                "AsyncAIPOConfig: save_strategy='best' saves when an evaluation finds a new best; evaluations here run "
                "on the generator and reach the trainer a few steps after the version they evaluated, whose weights "
                "are gone by then. Use save_strategy='steps' with save_steps equal to eval_steps (with "
                "load_best_model_at_end=True the best of those checkpoints is kept and loaded at the end).")
        if self.vllm_model_impl not in ("vllm", "transformers"):
            raise ValueError(f"AsyncAIPOConfig: vllm_model_impl={self.vllm_model_impl!r}; it must be 'vllm' (vLLM's "
                             "own model code) or 'transformers' (vLLM's transformers backend), as in GRPOConfig.")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError("AsyncAIPOConfig: num_generations_eval must be >= 1 (completions per eval prompt).")

    def _check_replicas(self) -> None:
        trainer_layout.check_generator_replicas(self)

    def _check_trainer_tp(self) -> int:
        return trainer_layout.check_fields(self)

    def _check_trainer_layout(self) -> None:
        trainer_layout.check_layout(self)

    def check_trainer_processes(self) -> None:
        """Refuse a trainer layout of several processes where there is one (`python script.py`)."""
        trainer_layout.check_processes(self)

    @property
    def trainer_only(self) -> bool:
        """A replica group other than 0 that shares group 0's generators: it starts none of its own."""
        return bool(self.trainer_replica_shared_generators) and self.trainer_replica_group != 0

    @property
    def num_generator_replicas(self) -> int:
        """Independent vLLM engines: num_generator_processes / generator_tensor_parallel_size."""
        return self.num_generator_processes // self.generator_tensor_parallel_size

    def _check_dynamic_sampling(self) -> None:
        extra = self.dynamic_sampling_extra_prompts
        if not _is_whole(extra) or extra < 0:
            raise ValueError(f"AsyncAIPOConfig: dynamic_sampling_extra_prompts={extra!r}; it must be a whole number >= 0.")
        if extra and not self.drop_zero_variance_groups:
            raise ValueError("AsyncAIPOConfig: dynamic_sampling_extra_prompts is set without drop_zero_variance_groups: "
                             "the extra prompts replace the groups dynamic sampling drops, and would otherwise never be "
                             "trained. Set drop_zero_variance_groups=True, or remove dynamic_sampling_extra_prompts.")
        if extra % self.num_data_parallel_trainers:
            raise ValueError(f"AsyncAIPOConfig: dynamic_sampling_extra_prompts={extra} must be a multiple of the "
                             f"{self.num_data_parallel_trainers} data-parallel trainer ranks (each trains its own "
                             "share of a batch).")

    @property
    def sampling(self) -> Sampling:
        """The sampling transforms, applied alike by vLLM and by the trainer's pi: the config's fields, where
        generation_kwargs does not set them (as TRL, generation_kwargs takes precedence)."""
        kw = self.generation_kwargs or {}
        top_k = kw.get("top_k", self.top_k)
        return Sampling(
            temperature=float(kw.get("temperature", self.temperature)),
            top_p=float(kw.get("top_p", self.top_p)),
            top_k=0 if top_k is None or top_k < 0 else int(top_k),
            min_p=float(kw.get("min_p", self.min_p) or 0.0),
            repetition_penalty=float(kw.get("repetition_penalty", self.repetition_penalty)),
            presence_penalty=float(kw.get("presence_penalty", 0.0)),
            frequency_penalty=float(kw.get("frequency_penalty", 0.0)),
        )

    @property
    def neutral_generation_kwargs(self) -> dict:
        """generation_kwargs that leave the sampled distribution alone (stop strings, ...), passed to vLLM as is."""
        return {k: v for k, v in (self.generation_kwargs or {}).items() if k in NEUTRAL_KWARGS}

    @property
    def algorithm_options(self) -> dict:
        """The options the algorithm plugin is built with (`hfllamarl.contracts.ALGORITHM_OPTIONS`, those its
        `__init__` names); an option set to other than its default that the algorithm does not take is refused."""
        from hfllamarl.contracts import ALGORITHM_OPTIONS, algorithm_kwargs
        from hfllamarl.registry import load_plugin

        defaults = {f.name: f.default for f in fields(self) if f.name in ALGORITHM_OPTIONS.values()}
        options = algorithm_kwargs(self.algorithm, load_plugin("algorithms", self.algorithm), self, defaults)
        if "off_policy_correction" in options:  # "auto": resolved by the job's staleness and loss
            from hfllamarl.corrections import resolve_config

            options["off_policy_correction"] = resolve_config(self, defaults, written_fields(self))
        return options

    def build_algorithm(self):
        """The algorithm plugin (`hfllamarl.contracts.Algorithm`) this config names, built with its options."""
        from hfllamarl.registry import load_plugin

        return load_plugin("algorithms", self.algorithm)(**self.algorithm_options)

    @property
    def generation_ticks(self) -> int:
        """The most ticks the generator spends on one batch (more than 1 only with partial rollouts)."""
        from hfllamarl.runtime.loop.schedule import ticks_per_batch

        return ticks_per_batch(self.max_completion_length, self.partial_rollout_tokens)

    def _check_quantization(self) -> None:
        q = self.generator_quantization
        if q is None:
            return
        if q not in _ONLINE_QUANTIZATION:
            raise ValueError(
                f"AsyncAIPOConfig: generator_quantization={q!r} is not supported; use one of "
                f"{sorted(_ONLINE_QUANTIZATION)} (quantization the generator applies itself to the weights the trainer "
                "sends: methods that need a pre-quantized checkpoint cannot follow a policy that changes every step)."
            )
        import torch

        if self.use_cpu or not torch.cuda.is_available():
            raise ValueError(
                f"AsyncAIPOConfig: generator_quantization={q!r} needs CUDA GPUs ({_ONLINE_QUANTIZATION[q]}); this "
                "job runs on the CPU. Remove generator_quantization (the generator then runs in generator_dtype), "
                "or launch on GPU machines."
            )

    @property
    def topology(self):
        """The process layout of this job (`hfllamarl.runtime.world.topology.Topology`)."""
        return self._topology

    @property
    def num_trainer_processes(self) -> int:
        return self._topology.num_trainers

    @property
    def num_data_parallel_trainers(self) -> int:
        """Trainer ranks that train different shares of a batch (the trainer processes over
        trainer_tensor_parallel_size: the ranks of a tensor-parallel group train the same share)."""
        return self._topology.data_parallel_size

    @property
    def completions_per_step(self) -> int:
        """Completions in one generation batch (= one optimizer step), over all data-parallel trainer ranks."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_data_parallel_trainers

    @property
    def prompts_per_step(self) -> int:
        """Prompts one optimizer step trains (whole groups of num_generations completions)."""
        return self.completions_per_step // self.num_generations

    @property
    def prompts_per_generation(self) -> int:
        """Prompts the generator samples per step: the step's, plus dynamic sampling's extra ones."""
        return self.prompts_per_step + self.dynamic_sampling_extra_prompts


def _is_whole(value) -> bool:
    """An int that is not a bool (`True` would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _differs(config, f) -> bool:
    default = f.default_factory() if f.default is MISSING else f.default
    value = getattr(config, f.name)
    return value != default and bool(value or default)  # ("", [] and None: the same unset setting)
