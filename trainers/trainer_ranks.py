"""The trainer ranks' side of `AsyncAIPOTrainer.train()`: shard, build the optimizer, log, save."""

from __future__ import annotations

import json
import logging
import math
import os
import time

import torch

from hfllamarl.runtime.weights import checkpoint
from hfllamarl.runtime.weights.fsdp import broadcast_from_rank0, loaded_on_rank0_only, shard_model
from hfllamarl.runtime.weights.loading import build_empty, init_lora, load_shards, materialize
from hfllamarl.runtime.weights.lora import is_peft
from hfllamarl.runtime.world.topology import launcher_attempt
from hfllamarl.runtime.training.attention import use_fast_cpu_attention
from hfllamarl.runtime.training.reporting import Reporter
from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec
from hfllamarl.runtime.loop.weights_channel import verify_dir

from .model_io import is_meta

logger = logging.getLogger(__name__)


def _check_accelerate(args) -> None:
    """Refuse distributed set-ups the trainer cannot honour instead of falling back silently."""
    from accelerate.utils import DistributedType

    state = getattr(args, "distributed_state", None)
    kind = getattr(state, "distributed_type", None)
    if kind == DistributedType.DEEPSPEED:
        raise RuntimeError("DeepSpeed was requested, but trainer ranks shard the policy with torch FSDP2; "
                           "use an FSDP (version 2) or multi-GPU/CPU accelerate config.")
    if os.environ.get("FSDP_VERSION", "2") not in ("2", "") and os.environ.get("ACCELERATE_USE_FSDP") == "true":
        raise RuntimeError("The accelerate config asks for FSDP version 1; hfllamarl trains with FSDP2 "
                           "(set fsdp_version: 2).")


def build_optimizer(model, args):
    """torch's AdamW (optim is checked by AsyncAIPOConfig), its fused kernel for `adamw_torch_fused` (transformers'
    default; on the CPU too, where it steps the FSDP2 shards of an 18.7M model about 5x faster than the default
    `foreach` path); as transformers' Trainer, weight decay applies to the weights of the linear layers and
    embeddings, not to biases and normalization weights."""
    from transformers.trainer_pt_utils import get_parameter_names

    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], [r"bias", r"layernorm", r"rmsnorm",
                                                                   r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trained if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in trained if n not in decay], "weight_decay": 0.0}]
    fused = str(getattr(args.optim, "value", args.optim)) == "adamw_torch_fused"
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, fused=fused or None)


def save_every(args, num_batches: int, batches_per_epoch: int | None = None) -> int:
    """Trainer steps between checkpoints (0: none), as TrainingArguments' save_strategy/save_steps mean it
    ("epoch": at the end of every pass over the dataset, `batches_per_epoch` steps). Trainer replica groups hold
    one policy and group 0 writes the checkpoints: none in the other groups, on their trainer and generator ranks
    alike (a generator that checkpointed alone would wait in the checkpoint's barrier for its trainer)."""
    if getattr(args, "trainer_replica_groups", 1) > 1 and getattr(args, "trainer_replica_group", 0) != 0:
        return 0
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "epoch":
        return max(1, batches_per_epoch or num_batches)
    if strategy != "steps" or not args.save_steps:
        return 0
    steps = args.save_steps
    return max(1, math.ceil(steps * num_batches)) if steps < 1 else int(steps)


def eval_every(args, num_batches: int, batches_per_epoch: int | None = None) -> int:
    """Policy versions between evaluations during training (0: none), as TrainingArguments' eval_strategy /
    eval_steps mean it (eval_steps unset: logging_steps; below 1: a share of the steps; "epoch": every pass)."""
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if strategy == "epoch":
        return max(1, batches_per_epoch or num_batches)
    if strategy != "steps":
        return 0
    steps = args.eval_steps if args.eval_steps is not None else args.logging_steps
    return max(1, math.ceil(steps * num_batches)) if steps < 1 else int(steps)


def eval_delay(args, batches_per_epoch: int | None = None) -> int:
    """The first policy version evaluated (eval_on_start's aside), as transformers' DefaultFlowCallback reads
    eval_delay: steps, or with eval_strategy="epoch" epochs."""
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if strategy == "epoch" and batches_per_epoch:
        return math.ceil(args.eval_delay * batches_per_epoch)
    return math.ceil(args.eval_delay or 0)


def _sequence_parallel(args, topo) -> bool:
    """Whether this job's trainer ranks split the sequence (the setting, where there is tensor parallelism to do it
    in: one process keeps a recipe's setting and trains without)."""
    return args.trainer_sequence_parallel and topo.trainer_tp > 1


def _shard(model, trainer) -> None:
    """FSDP2 (x the job's trainer tensor parallelism, with its sequence parallelism) over the trainer ranks."""
    args, topo = trainer.args, trainer.topology
    shard_model(model, topo.device_type, "bf16" if args.bf16 else None,
                sequence_parallel=_sequence_parallel(args, topo))


def _pad_multiple(args, topo) -> int | None:
    """The width a micro-batch is padded to a multiple of: pad_to_multiple_of, and with sequence parallelism the
    tensor-parallel group (the sequence splits evenly between its ranks)."""
    if _sequence_parallel(args, topo):
        return math.lcm(args.pad_to_multiple_of or 1, topo.trainer_tp)
    return args.pad_to_multiple_of


def prepare_policy(trainer, device: torch.device, resume_dir: str | None) -> None:
    """Shard the policy with FSDP2 and give each trainer rank its weights: read rank by rank from the model (or,
    on resume, the checkpoint) when it was built on the meta device; else from the object in memory."""
    args, model = trainer.args, trainer.model
    if is_meta(model):
        _shard(model, trainer)
        materialize(model, device)
        peft = is_peft(model)
        load_shards(model, resume_dir if resume_dir and not peft else trainer.model_path)
        if peft:  # the adapters: a fresh start, or the checkpoint's
            init_lora(model, seed=args.seed)
            if resume_dir:
                checkpoint.load_adapter_shards(model, resume_dir)
        return
    if loaded_on_rank0_only():  # the other trainer ranks hold empty weights until rank 0's arrive
        broadcast_from_rank0(model, device)
    if resume_dir:
        checkpoint.load_model_weights(model, resume_dir)  # a LoRA policy: its adapters
    model.to(device)
    _shard(model, trainer)


def prepare_reference(trainer, device: torch.device) -> torch.nn.Module:
    """The frozen reference policy (`beta > 0`): the starting policy, also after a resume, sharded like it."""
    args = trainer.args
    built = getattr(trainer, "_ref_model", None)
    if built is not None:  # a script read trainer.ref_model (built then), or an earlier train() sharded it
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(built, FSDPModule):
            built.to(device).eval()
            _shard(built, trainer)
        return built
    if is_meta(trainer.model):
        dtype = next(trainer.model.parameters()).dtype
        init = args.model_init_kwargs or {}
        ref = build_empty(trainer.model_config, dtype, init.get("attn_implementation"),
                          bool(init.get("trust_remote_code", args.trust_remote_code)))
        ref.requires_grad_(False)
        _shard(ref, trainer)
        materialize(ref, device)
        load_shards(ref, trainer.model_path)
        return ref.eval()
    import copy

    if loaded_on_rank0_only():
        broadcast_from_rank0(trainer.model, device)
    ref = copy.deepcopy(trainer.model)
    ref.requires_grad_(False)
    ref.to(device).eval()
    _shard(ref, trainer)
    return ref


def build_trainer_executor(trainer, backend, resume_dir: str | None = None,
                           unsampled: list[int] = ()) -> TrainerExecutor:
    """Shard the policy, build optimizer, scheduler and reporter; return the trainer executor.

    With `resume_dir`, the policy, optimizer, scheduler, RNG, state and unconsumed rollouts come from
    that checkpoint (`unsampled`: the batches the generator samples before the first tick, in the ledger)."""
    from transformers import get_scheduler

    args, topo = trainer.args, trainer.topology
    _check_accelerate(args)
    device = torch.device("cpu") if topo.use_cpu else torch.device("cuda", torch.cuda.current_device())
    model = trainer.model
    if args.disable_dropout:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    ref_model = prepare_reference(trainer, device) if args.beta > 0 else None
    trainer._ref_model = ref_model  # (TRL's `trainer.ref_model`)
    prepare_policy(trainer, device, resume_dir)
    named = "attn_implementation" in (args.model_init_kwargs or {})
    if use_fast_cpu_attention(model, device, named):  # (SDPA, or the plain form where measured faster: `attention`)
        logger.info("the trainer's attention on this CPU: SDPA, or the plain form for rows it measures faster on")
        if ref_model is not None:
            use_fast_cpu_attention(ref_model, device, named)
    model.train()
    weights = None
    if is_peft(model):  # the adapters alone, or the adapted layers merged (`lora_sync`)
        from hfllamarl.runtime.weights.lora import MergedLoraWeights
        from hfllamarl.runtime.weights.lora_adapters import AdapterWeights

        weights = AdapterWeights(model) if trainer.lora_sync == "adapter" else MergedLoraWeights(model)
    optimizer = build_optimizer(model, args)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                              num_warmup_steps=args.get_warmup_steps(trainer.num_steps),
                              num_training_steps=trainer.num_steps,
                              scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    reporter = Reporter(args, model, trainer.processing_class, optimizer, scheduler, trainer.callbacks,
                        max_steps=trainer.num_steps, is_world_zero=topo.rank == 0,
                        batches_per_epoch=trainer.batches_per_epoch)
    trainer.state, trainer._reporter = reporter.state, reporter
    trainer.optimizer, trainer.lr_scheduler = optimizer, scheduler

    every = save_every(args, trainer.num_steps, trainer.batches_per_epoch)
    group = replica_group(trainer, model, optimizer, scheduler, device)
    prompts_log = os.path.join(args.output_dir,
                               checkpoint.prompts_log_name(topo.rank, group.group if group is not None else None))
    holder, attempt = {}, launcher_attempt()

    def on_step(step: int, metrics: dict) -> bool:
        # Which dataset rows each step trained on, and when it ended (the last line for a step wins after a resume).
        with open(prompts_log, "a") as fh:
            line = {"step": step, "rows": holder["executor"].trained_rows[-1], "time": round(time.time(), 3),
                    "attempt": attempt}  # (the launcher's restart count: a restart is seen even where steps go on)
            if group is not None:  # (replica groups: the global step too)
                line["global_step"] = group.global_step
            fh.write(json.dumps(line) + "\n")
        reporter.step_end(step, metrics)
        if args.torch_empty_cache_steps and step % args.torch_empty_cache_steps == 0:  # as transformers' Trainer
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()
        reporter.control.should_save = False  # checkpoints follow `every`, on every rank alike
        if step < trainer.num_steps:
            reporter.step_begin()
        return checkpoint.due(step, every, trainer.num_steps)

    def on_save(step: int) -> None:
        directory = checkpoint.partial_dir(args.output_dir, step)
        reporter.note_checkpoint(step, saving=True)
        checkpoint.save_trainer_side(trainer, holder["executor"], step, directory)
        owing = holder["executor"].dispatch.owing_replicas() if holder["executor"].dispatch else set()
        checkpoint.commit(topo, args.output_dir, step, trainer.schedule.tick_of_step(step),
                          args.save_total_limit, checkpoint.job_signature(args),
                          required=[checkpoint.generator_file(r, topo.num_replicas) for r in sorted(owing)],
                          num_batches=trainer.num_batches, keep=reporter.protected_checkpoints())
        reporter.saved()

    spec = TrainerSpec(
        model=model, optimizer=optimizer, scheduler=scheduler, algorithm=trainer.algorithm,
        rewards=trainer.rewards, backend=backend, schedule=trainer.schedule,
        num_generations=args.num_generations,
        micro_batch_size=args.per_device_train_batch_size,
        dynamic_sampling_groups=(args.prompts_per_step // args.num_data_parallel_trainers
                                 if args.drop_zero_variance_groups else 0),
        sampling=args.sampling, max_grad_norm=args.max_grad_norm,
        pad_token_id=trainer.processing_class.pad_token_id, device=device, on_step=on_step,
        trainer_state=reporter.state, save_checkpoint=on_save, ref_model=ref_model,
        weights=weights,
        verify_dir=(lambda v: verify_dir(args.output_dir, v)) if args.verify_weight_sync else None,
        startup_timeout_s=args.vllm_server_timeout,
        max_completion_length=args.max_completion_length,
        mask_truncated_completions=args.mask_truncated_completions,
        on_samples=reporter.set_samples if args.log_completions else None,
        on_eval=reporter.evaluate,
        should_stop=reporter.stop_requested,
        padding_free=args.padding_free,
        share_prompts=args.share_prompts, skip_flat_rows=args.skip_flat_rows,
        skip_flat_backward=args.skip_flat_backward,
        pad_to_multiple_of=_pad_multiple(args, trainer.topology),
        tools=trainer.agent.uses_tools,
        router_aux_loss_coef=trainer.router_aux_loss_coef,
        top_entropy_quantile=args.top_entropy_quantile,
        ref_sync=(args.ref_model_mixup_alpha, args.ref_model_sync_steps) if args.sync_ref_model else None,
        replica_group=group, lookahead=args.sampler_lookahead == "adamw",
        replica_makeup=replica_makeup(trainer, model, device) if group is not None else None,
        trainer_only=args.trainer_only,
    )
    executor = holder["executor"] = TrainerExecutor(spec, topo)
    executor.head_start = head_start(trainer, model, device)
    os.makedirs(args.output_dir, exist_ok=True)
    if resume_dir:
        checkpoint.load_trainer_side(trainer, executor, resume_dir, unsampled)
    reporter.train_begin()
    reporter.step_begin()
    return executor


def head_start(trainer, model, device):
    """The trainer's head start on the generator's batches (`runtime.training.head_start`), or None (why: logged)."""
    from hfllamarl.runtime.training import head_start as start
    from hfllamarl.runtime.training.bootstrap import BootstrapSampler

    topo, spec = trainer.topology, trainer._generator_spec()
    why = start.blocker(trainer.args, spec, topo)
    if why is not None:
        if start.tokens_of(trainer.args.trainer_head_start) != 0:
            logger.info("the trainer takes no head start on the generator's batches: %s", why)
        return None
    sampler = BootstrapSampler(model, trainer.processing_class, trainer.train_dataset, spec, device,
                               generation_config=getattr(model, "generation_config", None))
    return start.HeadStart(sampler, topo.core_lender.board, start.tokens_of(trainer.args.trainer_head_start))


def replica_group(trainer, model, optimizer, scheduler, device):
    """trainer_replica_groups > 1: this job's handle on its group among the others (torchft); else None."""
    args, topo = trainer.args, trainer.topology
    if args.trainer_replica_groups == 1:
        return None
    from hfllamarl.runtime.training.replica_group import ReplicaGroup, lighthouse_address

    topo.store()
    return ReplicaGroup(args.trainer_replica_group, args.trainer_replica_groups,
                        lighthouse_address(args.torchft_lighthouse), model, optimizer, scheduler,
                        args.collective_timeout_s, device, store=tuple(topo.store_addr), rank=topo.local_rank,
                        world_size=topo.local_world_size, is_main=topo.rank == 0,
                        # (a group other than 0 alone at step 0 waits for a peer this long; its generators wait for its
                        # weights up to collective_timeout_s meanwhile)
                        peer_wait_s=min(args.vllm_server_timeout, args.collective_timeout_s / 2),
                        shared_generators=bool(args.trainer_replica_shared_generators))


def replica_makeup(trainer, model, device):
    """Trainer replica groups: what samples the shares of a step no group holds (`replica_makeup`)."""
    from hfllamarl.runtime.training.bootstrap import BootstrapSampler
    from hfllamarl.runtime.training.replica_makeup import ShareMakeup, blocker

    topo, spec = trainer.topology, trainer._generator_spec()
    why_not = blocker(spec) or ("trainer tensor parallelism shards the vocabulary the sampler draws from"
                                if topo.trainer_tp > 1 else None)
    sampler = None if why_not else BootstrapSampler(model, trainer.processing_class, trainer.train_dataset, spec, device,
                                                    generation_config=getattr(model, "generation_config", None))
    return ShareMakeup(sampler, topo.data_parallel_size, topo.data_rank_of(topo.rank), why_not)


def load_best_model(trainer) -> None:
    """load_best_model_at_end, on every trainer rank after the last step (before `on_train_end`, as transformers'
    Trainer): the policy of `state.best_model_checkpoint` replaces the final one in `trainer.model` (what
    `save_model()` then writes); a LoRA policy gets that checkpoint's adapters (its base never changes). Every rank
    holds the same best checkpoint (the evaluations' metrics are reduced over the ranks)."""
    import logging

    log = logging.getLogger(__name__)
    best = trainer.state.best_model_checkpoint
    if best is None or not os.path.isdir(best):
        log.warning("load_best_model_at_end: no evaluated policy version has a checkpoint; the final policy is kept "
                    "(save_steps equal to eval_steps checkpoints every evaluated version).")
        return
    log.info("Loading best model from %s (score: %s).", best, trainer.state.best_metric)
    if is_peft(trainer.model):
        checkpoint.load_adapter_shards(trainer.model, best)
    else:
        load_shards(trainer.model, best)


def bootstrap_first_batches(trainer, spec) -> TrainerExecutor:
    """A single-process job whose generators are starting (`hfllamarl.runtime.training.bootstrap`): build the
    trainer executor and train on batches the trainer samples itself until every generator has its engine up (or
    the bootstrap's limit). Joins the bridges as soon as the generators join them, so that they build their
    engines meanwhile. Returns the executor, its `first_tick` the generators' first batch (told them through the
    store before the start-up rendezvous)."""
    import time

    from hfllamarl.runtime.training import bootstrap
    from hfllamarl.runtime.world import startup
    from hfllamarl.runtime.world.liveness import STARTUP, _reached

    topo = trainer.topology
    executor = build_trainer_executor(trainer, None)
    executor.prepare()
    sampler = bootstrap.BootstrapSampler(trainer.model, trainer.processing_class, trainer.train_dataset, spec,
                                         executor.spec.device,
                                         generation_config=getattr(trainer.model, "generation_config", None))
    limit = bootstrap.batch_limit(trainer.schedule, spec.save_steps, spec.eval_every)
    joined = False
    # (past the start-up budget the trainer stops bootstrapping: it then waits for them as it would have)
    deadline = time.monotonic() + trainer.args.vllm_server_timeout

    def generators_ready() -> bool:
        nonlocal joined
        if not joined and startup.generators_reached(topo, "joining"):
            topo.join_bridges()  # (they wait in it: joined now, they go on to build their engines)
            joined = True
        return (joined and startup.generators_reached(topo, _reached(STARTUP))) or time.monotonic() > deadline

    began = time.perf_counter()
    done = bootstrap.run(executor, sampler, limit, generators_ready)
    executor.first_tick = done
    startup.hand_over(topo, done)
    if done:
        logger.info("bootstrap: the trainer sampled batches 0-%d itself (%.1f s) while the generator started and "
                    "trained %s; the generator samples from batch %d on", done - 1, time.perf_counter() - began,
                    "them" if executor.bootstrapped == done else f"the first {executor.bootstrapped} (batch {done - 1} "
                    "is trained in the first tick, beside the generator's first batch)", done)
    return executor
