"""`AsyncAIPOTrainer`: a TRL-style front-end over the asynchronous LlamaRL runtime.

    trainer = AsyncAIPOTrainer(model="path/to/model", reward_funcs="math_sympy",
                               args=AsyncAIPOConfig(...), train_dataset=dataset)
    trainer.train()

`train()` is called on every process. Trainer ranks train the policy (FSDP2) with the
algorithm plugin (AIPO by default); generator ranks run vLLM. Started as one process, the
trainer starts the generator ranks as child processes.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import shutil
import tempfile
import weakref

import torch
from transformers.trainer_utils import TrainOutput

from hfllamarl.runtime.weights import checkpoint
from hfllamarl.runtime.loop.controller import run_job, run_without_generators
from hfllamarl.runtime.generation.generator import GeneratorExecutor, GeneratorSpec
from hfllamarl.runtime.training import bootstrap
from hfllamarl.runtime.training.moe import aux_loss_coef
from hfllamarl.runtime.generation.preflight import check_generator
from hfllamarl.runtime.weights.lookahead import check_lookahead
from hfllamarl.runtime.weights.lora_adapters import adapter_config, choose_lora_sync, engine_rank
from hfllamarl.runtime.weights.tensor_parallel import check_trainer_tp
from hfllamarl.runtime.data.prompts import PromptEncoder, validate_dataset
from hfllamarl.runtime.data.reward_models import RewardModel
from hfllamarl.runtime.data.rewards import RewardRunner, resolve_reward_funcs
from hfllamarl.runtime.loop.schedule import Schedule
from hfllamarl.runtime.loop.weights_channel import build_backend
from hfllamarl.runtime.world import startup
from hfllamarl.runtime.world.topology import launcher_attempt

from .agent_setup import build_agent, check_dataset, placeholder_dataset, prepare_tokenizer, reward_weights
from .config import AsyncAIPOConfig
from .model_io import load_policy, resolve_model, save_for_generator
from .iterations import check_iterations
from .trainer_ranks import (bootstrap_first_batches, build_trainer_executor, eval_delay, eval_every, load_best_model,
                            save_every)

logger = logging.getLogger(__name__)


def run_length(rows: int, prompts: int, args) -> tuple[int, int]:
    """(optimizer steps of the run, optimizer steps per pass over the data set), as TRL counts steps: an epoch is
    the whole batches the data set fills (TRL's sampler drops a partial last one), each trained `num_iterations`
    times, and `num_train_epochs` a (possibly fractional) number of them, rounded up; `max_steps` wins. A data
    set smaller than one batch (TRL refuses it) is one batch a pass, its prompts repeated."""
    k = args.num_iterations
    per_epoch = max(1, rows // prompts) * k
    if args.max_steps and args.max_steps > 0:
        return args.max_steps, per_epoch
    return max(1, math.ceil(args.num_train_epochs * (per_epoch if rows >= prompts else k * rows / prompts))), per_epoch


class AsyncAIPOTrainer:
    """Asynchronous off-policy RL trainer with `GRPOTrainer`'s signature.

    Args:
        model: a local model directory (or hub id), a `PreTrainedModel`, or a peft `PeftModel` of one (a LoRA
            adapter; trained as given, with its own config; not together with `peft_config`, as in TRL).
        reward_funcs: a reward function with TRL's signature, a reward plugin name, a reward model (the directory
            of a sequence-classification model, or a `PreTrainedModel`: scored on the generator as each batch
            finishes), or a list mixing them.
        args: an `AsyncAIPOConfig`.
        train_dataset: a `datasets.Dataset` with a `prompt` column; other columns reach the reward functions.
        processing_class: the tokenizer (default: loaded from the model directory).
        reward_processing_classes: the reward models' tokenizers, one (or None) per reward function, as in TRL.
        callbacks: `transformers.TrainerCallback`s, fired on the trainer ranks.
        tools: functions (sync or async, type-hinted, Google-style docstring) the model may call, as in TRL; they
            run on the generator, each call bounded by `tool_call_timeout_s`.
        environment_factory: TRL's: a callable returning an environment (its public methods are tools, `reset()`
            may add to the prompt, an optional `get_reward()` scores the rollout), an installed environment plugin's
            name, or a dict of either by name (rows name theirs in an `environment` column). One per rollout.
        rollout_func: TRL's `rollout_func(prompts, trainer) -> dict`: a batch's whole generation loop, run on the
            generator with a trainer view that generates with the job's engine.
    """

    def __init__(self, model, reward_funcs=None, args: AsyncAIPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None,
                 rollout_func=None, environment_factory=None):
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            args = AsyncAIPOConfig(output_dir=f"{os.path.basename(str(name).rstrip('/'))}-AIPO")
        if not isinstance(args, AsyncAIPOConfig):
            raise TypeError(
                f"args must be an AsyncAIPOConfig, got {type(args).__name__}. AsyncAIPOConfig takes every GRPOConfig "
                "field plus the generator settings (num_generator_processes, max_staleness, aipo_rho, ...)."
            )
        if optimizers != (None, None):
            raise ValueError("optimizers: the optimizer is built after FSDP2 sharding; set learning_rate, "
                             "weight_decay, adam_* and lr_scheduler_type in AsyncAIPOConfig instead.")
        if quantization_config is not None:
            raise ValueError("quantization_config (a 4/8-bit bitsandbytes base model, QLoRA) is not supported: the "
                             "trainer ranks shard the policy with FSDP2 and send its weights to vLLM at every step. "
                             "Train LoRA adapters on a bf16 base (peft_config) instead.")
        self.args, self.topology = args, args.topology
        # Where the last train()'s start-up went, in seconds after train() (`hfllamarl.runtime.world.startup`; the
        # first trainer rank fills it after the first step)
        self.startup_profile: dict[str, float] = {}
        from transformers.trainer_utils import enable_full_determinism, set_seed
        from transformers.utils import logging as hf_logging

        # As transformers' Trainer: its log level (log_level / log_level_replica / log_on_each_node) on each process,
        # and python, numpy and torch seeded on every process (dropout, reward functions)
        hf_logging.set_verbosity(args.get_process_log_level())
        if args.full_determinism:
            enable_full_determinism(args.seed)
        else:
            set_seed(args.seed)
        # Plain python: the generator children start now, so that vLLM's import overlaps the set-up below.
        prestarted = self.topology.prestart_children(args.output_dir) if self.topology.role == "trainer" else None
        if prestarted is not None:
            weakref.finalize(self, prestarted.release)  # a trainer dropped without train() lets them go
        try:
            self._set_up(model, reward_funcs, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, peft_config, tools, rollout_func, environment_factory)
        except BaseException:
            if prestarted is not None:
                prestarted.release()
            raise
        if self.topology.role == "generator":  # a launcher's generator rank: vLLM's import overlaps the trainers'
            from hfllamarl.runtime.world.collector import collector_paused  # set-up (loading the policy)
            from hfllamarl.runtime.generation.engine import import_vllm

            with collector_paused(freeze=False):
                import_vllm()

    def _set_up(self, model, reward_funcs, train_dataset, eval_dataset, processing_class, reward_processing_classes,
                callbacks, peft_config, tools, rollout_func, environment_factory) -> None:
        args = self.args
        self.agent = agent = build_agent(args, tools, environment_factory, rollout_func)
        user_funcs = [] if reward_funcs is None and agent.env_rewards else resolve_reward_funcs(
            reward_funcs, reward_processing_classes, trust_remote_code=args.trust_remote_code,
            model_init_kwargs=args.model_init_kwargs)
        self.reward_funcs = user_funcs + agent.env_rewards  # an environment's get_reward: a reward named after it
        # TRL's attribute: one tokenizer per reward function, None for a function that is not a model (and for a
        # model given without one: it loads its own tokenizer when it first scores).
        self.reward_processing_classes = [f._tokenizer if isinstance(f, RewardModel) else None for f in user_funcs]
        self.rewards = RewardRunner(self.reward_funcs, reward_weights(args, len(user_funcs), agent),
                                    on_error=args.reward_errors, aggregation=args.multi_objective_aggregation)
        # TRL's attributes: each reward's name (an environment's reward: its class) and weight, and the tools
        self.reward_func_names = list(self.rewards.names)
        self.reward_weights = torch.tensor(self.rewards.weights, dtype=torch.float32)
        self.tools = list(agent.tools)
        self.algorithm = args.build_algorithm()
        if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            logger.warning("importance_sampling_level='sequence' with loss_type=%r: that loss sums per-token terms, "
                           "which weights each sequence by its completion length instead of optimising the "
                           "per-sequence objective; for GSPO's setup use loss_type='grpo'.", args.loss_type)
        from hfllamarl.runtime.weights.lora import check_peft_inputs

        check_peft_inputs(model, peft_config)  # every rank alike, before anything starts
        self.model_path, model_obj, model_config = resolve_model(model, args)
        self.model_config = model_config
        self.router_aux_loss_coef = aux_loss_coef(model_config, args.router_aux_loss_coef)  # MoE: as TRL adds it
        self._model_obj = model_obj
        self._peft_config = peft_config
        self.lora_sync, why = choose_lora_sync(args.lora_sync, peft_config, model_obj, model_config,
                                               use_cpu=self.topology.use_cpu, quantization=args.generator_quantization,
                                               model_impl=args.vllm_model_impl)
        if self.lora_sync != "none" and self.topology.rank == 0:
            logger.info("LoRA weight sync: %s (%s)", self.lora_sync, why)
        check_lookahead(args.sampler_lookahead, peft_config)
        check_generator(model_config, use_cpu=args.use_cpu, dtype=self._generator_dtype(),
                        tensor_parallel_size=args.generator_tensor_parallel_size, model_impl=args.vllm_model_impl)
        args.check_trainer_processes()
        check_trainer_tp(model_config, args.trainer_tensor_parallel_size, peft_config, model_obj)
        if processing_class is None:
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(self.model_path)
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        self.processing_class = processing_class
        prepare_tokenizer(agent, processing_class, args)  # tools: a template that renders and parses tool calls
        if train_dataset is None:  # an environment's reset() writes the prompts (TRL)
            train_dataset = placeholder_dataset(agent, args, args.prompts_per_step)
        elif agent.spec is not None and agent.spec.factories and "prompt" not in train_dataset.column_names:
            # TRL: rows that only route to an environment; its reset() writes the prompt, as for placeholder rows
            train_dataset = train_dataset.add_column("prompt", [[{"role": "user", "content": ""}]] * len(train_dataset))
        self.train_dataset = train_dataset = _used_columns(train_dataset, args)
        self.max_model_len = args.vllm_max_model_length or getattr(model_config, "max_position_embeddings", None)
        if not self.max_model_len:
            raise ValueError("Cannot tell the model's context length; set vllm_max_model_length in AsyncAIPOConfig.")
        encoder = PromptEncoder(processing_class, args.chat_template_kwargs, agent.tools, agent.chat_template)
        check_dataset(agent, train_dataset)
        validate_dataset(train_dataset, encoder, args.max_completion_length, self.max_model_len)
        self.eval_dataset = _used_columns(_eval_dataset(eval_dataset, args), args)
        if self.eval_dataset is not None:
            validate_dataset(self.eval_dataset, encoder, args.max_completion_length, self.max_model_len)
        prompts = args.prompts_per_generation  # a generation batch: the step's prompts (+ dynamic sampling's extra)
        # batches_per_epoch: optimizer steps per pass over the data (batches x num_iterations), as TRL counts epochs
        num_steps, self.batches_per_epoch = run_length(len(train_dataset), prompts, args)
        if args.trainer_replica_shared_generators and args.trainer_replica_group == 0:  # (every group's share)
            prompts *= args.trainer_replica_groups
        self.schedule = Schedule.of_steps(num_steps, args.max_staleness, args.generation_ticks, prompts,
                                          args.num_iterations,
                                          eval_every=eval_every(args, num_steps, self.batches_per_epoch)
                                          if self.eval_dataset is not None else 0,
                                          eval_delay=eval_delay(args, self.batches_per_epoch),
                                          eval_last=True)  # (as DefaultFlowCallback at max_steps, or the last epoch's end)
        check_iterations(args, self.schedule, self.batches_per_epoch, self.eval_dataset is not None, model_obj,
                         peft_config)
        self.callbacks = callbacks
        self.model = None
        if self.topology.role == "generator":  # what a script touches of trainer.model on every process
            from .script_api import GeneratorRankModel

            self.model = GeneratorRankModel(model_config, self.model_path)
        if self.topology.role == "trainer":
            self.model = model_obj if model_obj is not None else load_policy(self.model_path, args, model_config,
                                                                              self.topology.num_trainers)
            if peft_config is not None:  # the trainer trains adapters; the generator gets merged weights
                from hfllamarl.runtime.weights.lora import apply_peft

                self.model = apply_peft(self.model, peft_config)
        self.state = None

    @property
    def num_batches(self) -> int:
        """Generation batches of the whole run (= optimizer steps with num_iterations=1)."""
        return self.schedule.num_batches

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the whole run (TRL's max_steps): num_iterations per generation batch."""
        return self.schedule.num_steps

    # ------------------------------------------------------------------ public API
    def train(self, resume_from_checkpoint=None, **kwargs) -> TrainOutput:
        """Run the whole job; call it on every process."""
        topo = self.topology
        startup.reset()
        startup.mark("train")
        spec = self._generator_spec()
        # (torchrun --max-restarts) Replica groups: group 0 resumes from its own checkpoints too, and then copies the
        # policy from a live group that is ahead of it, if any; the other groups write none and copy it from a peer.
        resume_from_checkpoint, restarted = checkpoint.after_restart(
            resume_from_checkpoint, self.args.output_dir,
            launcher_attempt() if self.args.trainer_replica_group == 0 else 0,
            replica_groups=self.args.trainer_replica_groups > 1)
        if restarted and topo.rank == 0:
            logger.warning(restarted)
        resume = checkpoint.resolve(resume_from_checkpoint, self.args.output_dir)
        start_tick, resume_dir, unsampled = 0, None, []
        if resume is not None and self.args.trainer_replica_groups > 1 and self.args.trainer_replica_group != 0:
            raise ValueError(f"trainer replica group {self.args.trainer_replica_group}: checkpoints are group 0's (its "
                             "rollouts are its own share): resume group 0 from it, and start the other groups without "
                             "resume_from_checkpoint; they copy the policy from group 0 at their first step.")
        if resume is not None:
            resume_dir, marker = resume
            checkpoint.check_resumable(resume_dir, marker, topo, self.args)
            if marker["step"] >= self.num_steps:  # a finished run: nothing to do, as transformers' Trainer
                return self._finished(resume_dir, marker)
            start_tick = marker["tick"] + 1
            spec.unsampled = unsampled = checkpoint.unsampled_batches(marker, self.schedule)  # (a longer run)
            # The generator starts from the checkpoint's policy: what it would hold at the next tick.
            if spec.lora_adapter is not None:  # the engine keeps the base weights; the checkpoint's adapters go on them
                spec.lora_adapter["start"] = os.path.join(resume_dir, checkpoint.ADAPTER_DIR)
            else:
                spec.model_path = spec.tokenizer_path = resume_dir
            spec.initial_version, spec.resume_dir = marker["step"], resume_dir
        if topo.rank == 0:  # before any rank can start a checkpoint of this run
            for name in checkpoint.remove_partial(self.args.output_dir):
                logger.warning("removed %s, a checkpoint a stopped run left half-written", name)
        alone = self.args.trainer_only  # (a replica group sharing group 0's generators: none of its own)
        if topo.mode == "single" and not alone:
            topo.new_job()
            why_not = bootstrap.blocker(self.args, spec, topo, resuming=resume is not None)
            spec.bootstrapped = why_not is None
            if why_not and self.args.bootstrap_generation:
                logger.info("the trainer waits for the generator's start-up (no bootstrap: %s)", why_not)
            self._start_children(spec, start_tick)
        finished, executor = False, None
        try:
            topo.init_local_world()
            if alone:  # no generator, no channel: each step trains the share group 0 hands it (`replica_exchange`)
                executor = build_trainer_executor(self, None)
                run_without_generators(executor, self.schedule)
                summary = self._reporter.train_end()
                finished = True
                return TrainOutput(self.state.global_step, summary["train_loss"], summary)
            if topo.mode == "single":
                topo.liveness.start()
                if spec.bootstrapped:  # train on its own samples while the generators start
                    executor = bootstrap_first_batches(self, spec)
                topo.liveness.await_joining(topo.generator_ranks, self.args.vllm_server_timeout)
            topo.join_bridges()  # every rank joins its bridge groups up front
            backend = build_backend(self.args.weight_sync_backend, topo, **spec.weight_sync_options)
            if topo.role == "generator":
                if self._model_obj is not None and topo.mode == "launcher" and not spec.resume_dir:
                    where = os.path.join(self.args.output_dir, ".hfllamarl", f"generator-model-rank{topo.rank}")
                    spec.model_path = spec.tokenizer_path = save_for_generator(
                        self._model_obj, self.processing_class, where)
                # (every rank built the same processing_class from the same script: this rank writes its own copy)
                spec.tokenizer_path = self._save_tokenizer(
                    os.path.join(self.args.output_dir, ".hfllamarl", f"generator-tokenizer-rank{topo.rank}"))
                run_job(GeneratorExecutor(spec, topo), backend, topo, self.schedule, start_tick)
                return TrainOutput(self.num_steps, 0.0, {})
            executor = executor or build_trainer_executor(self, backend, resume_dir, unsampled)
            run_job(executor, backend, topo, self.schedule, start_tick)
            self.startup_profile = executor.startup_profile
            if self.args.load_best_model_at_end:
                load_best_model(self)
            summary = self._reporter.train_end()
            if topo.mode == "single":  # the children are done too (one frozen or dead after the last step: raised)
                topo.liveness.finish()
            finished = True
            return TrainOutput(self.state.global_step, summary["train_loss"], summary)
        except BaseException:
            if getattr(self, "_reporter", None) is not None:
                self._reporter.abort()
            raise
        finally:
            group = getattr(getattr(executor, "spec", None), "replica_group", None)
            if group is not None:  # leave the quorum (the other groups go on without this one)
                group.shutdown()
            if topo.mode == "single" and not alone:  # on an error, do not wait for children stuck in a channel
                topo.stop_children(grace_s=10.0 if finished else 2.0, finished=finished)
                shutil.rmtree(getattr(self, "_workdir", ""), ignore_errors=True)

    def _finished(self, directory: str, marker: dict) -> TrainOutput:
        """Resuming from a checkpoint at (or past) the last step: return its state at once, starting nothing."""
        from transformers.trainer_callback import TrainerState

        logger.info("checkpoint %s is at step %d of a %d-step run: nothing left to train", directory, marker["step"],
                    self.num_steps)
        self.topology.release_prestarted()
        if self.topology.mode != "single":  # this rank ends normally: its silence from now on is no loss
            self.topology.liveness.mark_done()
        if self.topology.role == "trainer":
            self.state = TrainerState.load_from_json(os.path.join(directory, "trainer_state.json"))
        return TrainOutput(marker["step"], self._last_loss(), {})

    @property
    def accelerator(self):
        """What TRL scripts use of `trainer.accelerator` (`print` once per job, process index and count,
        `wait_for_everyone`, `end_training`)."""
        from .script_api import JobAccelerator

        return JobAccelerator(self)

    @property
    def hub_model_id(self) -> str:
        from .script_api import hub_model_id

        return hub_model_id(self)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, token=None,
                    revision=None, **kwargs):
        """Save the policy to `output_dir` and upload it to the Hub repository `hub_model_id` (call it on every
        process, after `train()`)."""
        from .script_api import push_to_hub

        return push_to_hub(self, commit_message, blocking, token, revision, **kwargs)

    def end(self) -> None:
        """Release the job's process groups, as transformers' `Trainer.end()` (call it last, on every process)."""
        from .script_api import end

        end(self)

    def is_world_process_zero(self) -> bool:
        """Whether this process is the job's process 0 (trainer rank 0), as `Trainer.is_world_process_zero`."""
        return self.topology.rank == 0

    def is_local_process_zero(self) -> bool:
        """Whether this process is the first of its machine, as `Trainer.is_local_process_zero`."""
        return self.topology.mode == "single" or int(os.environ.get("LOCAL_RANK", "0")) == 0

    def log_metrics(self, split: str, metrics: dict) -> None:
        """Print `metrics` formatted, on the job's process 0, as `Trainer.log_metrics` (e.g. `train()`'s metrics)."""
        from transformers.trainer_pt_utils import log_metrics

        if metrics:  # (a resumed, finished run returns none)
            log_metrics(self, split, metrics)

    def metrics_format(self, metrics: dict) -> dict:
        from transformers.trainer_pt_utils import metrics_format

        return metrics_format(metrics)

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """`{split}_results.json` (and `all_results.json`) in output_dir, as `Trainer.save_metrics`."""
        from .script_api import save_metrics

        save_metrics(self, split, metrics, combined)

    def save_state(self) -> None:
        """`trainer_state.json` in output_dir, as `Trainer.save_state`."""
        from .script_api import save_state

        save_state(self)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """Write a model card (`README.md`) to output_dir, as TRL's `create_model_card`."""
        from .script_api import create_model_card

        create_model_card(self, model_name, dataset_name, tags)

    def evaluate(self, *args, **kwargs):
        """Not available: evaluation runs on the generator during `train()`."""
        raise NotImplementedError(
            "trainer.evaluate() is not available: evaluation runs on the generator ranks during train() "
            "(eval_dataset with eval_strategy='steps' or 'epoch'; the eval_* metrics are in trainer.state.log_history "
            "and reach on_evaluate callbacks). To evaluate the saved model, run `hfllamarl eval --model OUTPUT_DIR --data DATA.jsonl`.")

    def add_callback(self, callback) -> None:
        """Add a `transformers.TrainerCallback` (an instance or a class), as `Trainer.add_callback`."""
        self.callbacks = list(self.callbacks or []) + [callback]

    @property
    def callback_handler(self):
        """The run's `transformers.CallbackHandler` (its `.callbacks`: the `report_to` integrations, the progress
        bar and the callbacks added), as `Trainer.callback_handler`; None before `train()` and on generator ranks."""
        reporter = getattr(self, "_reporter", None)
        return reporter.handler if reporter is not None else None

    def save_model(self, output_dir: str | None = None) -> None:
        """Save the policy and the tokenizer; call it on every trainer rank. As TRL's: a LoRA policy's adapters in
        peft's format (adapter_config.json, adapter_model.safetensors), any other policy whole (unsharded)."""
        if self.topology.role != "trainer":
            return
        checkpoint.save_model(self, output_dir or self.args.output_dir)

    # ------------------------------------------------------------------ internals
    def _generator_spec(self) -> GeneratorSpec:
        a = self.args
        return GeneratorSpec(
            model_path=self.model_path,
            tokenizer_path=self.model_path,
            dataset=self.train_dataset,
            schedule=self.schedule,
            prompts_per_batch=a.prompts_per_generation,
            num_generations=a.num_generations,
            max_completion_length=a.max_completion_length,
            max_model_len=self.max_model_len,
            seed=a.seed,
            shuffle=a.shuffle_dataset,
            sampling=a.sampling,
            generation_kwargs=a.neutral_generation_kwargs,
            chat_template_kwargs=a.chat_template_kwargs or {},
            dtype=self._generator_dtype(),
            enforce_eager=a.generator_enforce_eager,
            quantization=a.generator_quantization,
            model_impl=a.vllm_model_impl,
            kv_cache_bytes=a.generator_kv_cache_bytes,
            gpu_memory_utilization=a.vllm_gpu_memory_utilization,
            tensor_parallel_size=a.generator_tensor_parallel_size,
            weight_sync_backend=a.weight_sync_backend,
            weight_sync_options={"transfer_dtype": self._generator_dtype()},
            output_dir=a.output_dir,
            save_steps=save_every(a, self.num_steps, self.batches_per_epoch),
            save_total_limit=a.save_total_limit,
            partial_rollout_tokens=a.partial_rollout_tokens,
            verify_weight_sync=a.verify_weight_sync,
            startup_timeout_s=a.vllm_server_timeout,
            reward_models=[f for f in self.reward_funcs if isinstance(f, RewardModel)],
            eval_dataset=self.eval_dataset,
            eval_every=eval_every(a, self.num_steps, self.batches_per_epoch) if self.eval_dataset is not None else 0,
            eval_on_start=bool(a.eval_on_start),
            eval_delay=eval_delay(a, self.batches_per_epoch),
            num_generations_eval=a.num_generations_eval or a.num_generations,
            agent=self.agent.spec,
            lora_adapter=({"config": adapter_config(self._peft_config), "rank": engine_rank(self._peft_config)}
                          if self.lora_sync == "adapter" else None),
            replica_group=a.trainer_replica_group, replica_groups=a.trainer_replica_groups,
            shared_generators=bool(a.trainer_replica_shared_generators),  # (refused with one group)
        )

    def _generator_dtype(self) -> str:
        """'auto' is the trainer's compute dtype (bf16 under bf16 mixed precision, else the parameters'
        dtype), so that with max_staleness=0 the ratio pi/mu is 1 up to kernel differences."""
        if self.args.generator_dtype != "auto":
            return self.args.generator_dtype
        if self.args.bf16:
            return "bfloat16"
        dtype = (self.args.model_init_kwargs or {}).get("dtype", torch.float32)
        if self._model_obj is not None:
            dtype = next(self._model_obj.parameters()).dtype
        return str(dtype).replace("torch.", "")

    @property
    def ref_model(self):
        """TRL's reference model: None without one (`beta == 0`) and on generator ranks. Read before `train()`, it is
        built then (a frozen copy of the starting policy, as TRL builds it at construction) and is the one the
        trainer ranks then shard and use; during and after `train()`, that sharded model."""
        if self.args.beta == 0 or self.topology.role != "trainer":
            return None
        if getattr(self, "_ref_model", None) is None:
            import copy

            from .model_io import is_meta, load_policy

            start = (load_policy(self.model_path, self.args, self.model_config, 1) if is_meta(self.model)
                     else copy.deepcopy(self.model))
            self._ref_model = start.requires_grad_(False).eval()
        return self._ref_model

    @property
    def _logs(self) -> dict:
        """TRL's buffer of the completions last logged, in TRL's shape (`prompt`, `completion`, `rewards` per
        function, `advantages`, `extra`: log_extra's columns), on the first trainer rank with `log_completions`
        (empty elsewhere: the samples are gathered there only to be logged)."""
        samples = getattr(getattr(self, "_reporter", None), "logged_samples", None) or {}
        skip = ("prompt", "completion", "advantage", "extra")
        return {"prompt": list(samples.get("prompt", [])), "completion": list(samples.get("completion", [])),
                "rewards": {k: list(v) for k, v in samples.items() if k not in skip},
                "advantages": list(samples.get("advantage", [])),
                "extra": {k: list(v) for k, v in (samples.get("extra") or {}).items()}, "images": []}

    def _save_tokenizer(self, directory: str) -> str:
        """Write `processing_class` (the user's, with its chat template, or the model's) where the generator loads
        it, so that prompts are rendered with the tokenizer the trainer uses, on a resume too (a checkpoint's copy,
        as TRL saves it, is what the next run is given back). Returns `directory`."""
        os.makedirs(directory, exist_ok=True)
        self.processing_class.save_pretrained(directory)
        # vLLM reads the model's config from the tokenizer's directory too (without it: a parse error and two
        # retries, seconds of start-up)
        self.model_config.save_pretrained(directory)
        return directory

    def _start_children(self, spec: GeneratorSpec, start_tick: int = 0) -> None:
        """Single-process mode: hand the generator its model, tokenizer and data through files."""
        os.makedirs(self.args.output_dir, exist_ok=True)
        workdir = tempfile.mkdtemp(prefix=".hfllamarl-generator-", dir=self.args.output_dir)
        self._workdir = workdir
        if self._model_obj is not None and not spec.resume_dir:
            spec.model_path = spec.tokenizer_path = save_for_generator(self._model_obj, self.processing_class,
                                                                       os.path.join(workdir, "model"))
        spec.tokenizer_path = self._save_tokenizer(os.path.join(workdir, "tokenizer"))
        spec.reward_models = [m.portable(os.path.join(workdir, f"reward_model_{i}"))
                              for i, m in enumerate(spec.reward_models)]
        data_dir = os.path.join(workdir, "dataset")
        self.train_dataset.save_to_disk(data_dir)
        spec.dataset = data_dir
        if spec.eval_dataset is not None:
            spec.eval_dataset.save_to_disk(os.path.join(workdir, "eval_dataset"))
            spec.eval_dataset = os.path.join(workdir, "eval_dataset")
        spec_path = os.path.join(workdir, "generator_spec.pkl")
        with open(spec_path, "wb") as fh:
            pickle.dump({"spec": spec, "use_cpu": self.args.use_cpu, "timeout_s": self.args.collective_timeout_s,
                         "num_generators": self.topology.num_generators, "start_tick": start_tick,
                         "tensor_parallel_size": self.topology.replica_size, "failure": self.topology.failure}, fh)
        self.topology.store()
        self.topology.start_children(spec_path)

    def _last_loss(self) -> float:
        for row in reversed(self.state.log_history if self.state else []):
            if "loss" in row:
                return float(row["loss"])
        return 0.0


def _eval_dataset(dataset, args):
    """The evaluation set, checked against eval_strategy: evaluation happens during training only, on the generator
    (there is no `trainer.evaluate()`), so each needs the other."""
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if dataset is None:
        if strategy != "no":
            raise ValueError(f"eval_strategy={strategy!r} needs an eval_dataset (a datasets.Dataset with a `prompt` "
                             "column); pass one, or set eval_strategy='no'.")
        return None
    if isinstance(dataset, dict):
        raise ValueError("eval_dataset: several named evaluation sets (a dict) are not supported yet; pass one "
                         "datasets.Dataset.")
    if strategy == "no":
        raise ValueError("eval_dataset is evaluated during training, at eval_strategy's steps, and eval_strategy is "
                         "'no': set eval_strategy='steps' (with eval_steps) or 'epoch', or leave eval_dataset out.")
    if args.metric_for_best_model in ("loss", "eval_loss"):  # (other names are checked at the first evaluation)
        raise ValueError(f"metric_for_best_model={args.metric_for_best_model!r}: an evaluation here samples and scores "
                         "completions of the eval prompts, with no loss; use one of its metrics, e.g. 'reward' "
                         "(eval_reward) or 'rewards/<function>/mean'.")
    return dataset


def _used_columns(dataset, args):
    """`remove_unused_columns=True`: as TRL's GRPOTrainer (through transformers' Trainer), only the columns it reads
    (`prompt`, `image`, `images`) are kept, so reward functions get no other column."""
    columns = getattr(dataset, "column_names", None)
    if not args.remove_unused_columns or not columns or not hasattr(dataset, "remove_columns"):
        return dataset
    unused = [c for c in columns if c not in ("prompt", "image", "images")]
    return dataset.remove_columns(unused) if unused else dataset
