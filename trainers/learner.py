"""The trainer ranks' side of `AsyncAIPOTrainer.train()`: shard, build the optimizer, log, save."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from hfllamarl.fsdp import full_state_dict, shard_model
from hfllamarl.reporting import Reporter
from hfllamarl.trainer_executor import TrainerExecutor, TrainerJob


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


def check_optimizer(args) -> None:
    name = str(getattr(args.optim, "value", args.optim))
    if not name.startswith("adamw_torch"):
        raise ValueError(f"optim={name!r} is not supported; use adamw_torch or adamw_torch_fused (the default).")


def build_optimizer(model, args):
    check_optimizer(args)
    return torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=args.weight_decay)


def build_trainer_executor(trainer, backend) -> TrainerExecutor:
    """Shard the policy, build optimizer, scheduler and reporter; return the trainer executor."""
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
    model.to(device)
    model.train()
    shard_model(model, topo.device_type, "bf16" if args.bf16 else None)
    optimizer = build_optimizer(model, args)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                              num_warmup_steps=args.get_warmup_steps(trainer.num_batches),
                              num_training_steps=trainer.num_batches,
                              scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    reporter = Reporter(args, model, trainer.processing_class, optimizer, scheduler, trainer.callbacks,
                        max_steps=trainer.num_batches, is_world_zero=topo.rank == 0)
    trainer.state, trainer._reporter = reporter.state, reporter
    trainer.optimizer, trainer.lr_scheduler = optimizer, scheduler

    def on_step(step: int, metrics: dict) -> bool:
        due = reporter.step_end(step, metrics)
        if step < trainer.num_batches:
            reporter.step_begin()
        return due

    def on_save(step: int) -> None:
        save_checkpoint(trainer, step)
        reporter.saved()

    job = TrainerJob(
        model=model, optimizer=optimizer, scheduler=scheduler, algorithm=trainer.algorithm,
        rewards=trainer.rewards, backend=backend, num_batches=trainer.num_batches,
        max_staleness=args.max_staleness, num_generations=args.num_generations,
        micro_batch_size=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
        temperature=args.temperature, max_grad_norm=args.max_grad_norm,
        pad_token_id=trainer.processing_class.pad_token_id, device=device, on_step=on_step,
        trainer_state=reporter.state, save_checkpoint=on_save,
    )
    executor = TrainerExecutor(job, topo)
    reporter.train_begin()
    reporter.step_begin()
    return executor


def save_policy(trainer, output_dir: str) -> None:
    """Gather the full policy (a collective over the trainer world) and save it on trainer rank 0."""
    state = full_state_dict(trainer.model)
    if trainer.topology.rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        trainer.model.save_pretrained(output_dir, state_dict=state)
        trainer.processing_class.save_pretrained(output_dir)
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(trainer, step: int) -> None:
    """`output_dir/checkpoint-<step>`: the policy, the tokenizer and `trainer_state.json`."""
    directory = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
    save_policy(trainer, directory)
    if trainer.topology.rank == 0:
        trainer.state.save_to_json(os.path.join(directory, "trainer_state.json"))
        with open(os.path.join(directory, "hfllamarl.json"), "w") as fh:
            json.dump({"policy_version": step}, fh)
