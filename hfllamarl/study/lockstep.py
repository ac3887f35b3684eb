"""One run of the staleness study: the product's trainer, fed batches exactly `max_staleness` versions old.

The asynchronous runtime trains batch b at policy version b, on completions its generator sampled with version
b - s (`hfllamarl.runtime.loop.schedule`; the first s batches with version 0). How far it stays on that schedule
depends on nothing but the schedule, yet a generator process's timing, vLLM's kernels and the threads the two
sides lend each other make two runs of one seed differ, which a study of corrections cannot afford. This runner
holds the schedule exactly and deterministically, in one process:

- the trainer is the one `AsyncAIPOTrainer` builds (`build_trainer_executor`: FSDP2 over one rank, the optimizer,
  the scheduler, the algorithm plugin, the reward runner), trained by the same `TrainerExecutor.step`;
- batch b is sampled by `BootstrapSampler` (what the trainer uses to sample its own first batches: the same
  prompts, the same sampling distribution, the behaviour log-prob of each token recorded as the generator records
  it) on a copy of the policy holding version max(0, b - s), kept from the trainer's own weights after each step.

So every batch from the s-th on is exactly s versions old (`staleness/mean` logs it), and a seed gives the same run
every time on one machine. What it does not exercise: vLLM, the weight sync and the overlap itself (the runtime's
benches measure those); the runtime's own learning is checked against it by `hfllamarl bench learning --runtime`.
It keeps s + 1 whole copies of the policy's weights (the versions batches are still sampled with): a study for
small models, or for a machine with the memory for them.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections import deque

#: What each step's log contributes to a cell's record, when the step logged it.
SERIES = ("reward", "is_ratio/mean", "is_ratio/max", "is_ratio/min", "behavior_kl", "clipped_frac",
          "correction/masked_frac", "correction/clipped_frac", "correction/trust_masked_frac", "correction/ess",
          "correction/step_scale", "staleness/mean", "grad_norm", "entropy")


def snapshot(model) -> dict:
    """The policy's weights, whole (FSDP2's DTensors gathered), detached copies."""
    out = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = value.detach().clone()
    return out


def run(model_path: str, rows: list[dict], reward_funcs, config: dict, quiet: bool = True) -> dict:
    """Train one run with exact staleness; returns `{"series": {name: [per step]}, "seconds": float}`.

    Args:
        model_path: a model directory (`from_pretrained`).
        rows: the training rows (a "prompt" column and the reward's columns).
        reward_funcs: what `AsyncAIPOTrainer` takes.
        config: `AsyncAIPOConfig` fields (max_staleness, algorithm, loss_type, ..., max_steps, seed).
        quiet: keep the trainer's per-step log lines off stdout.
    """
    from hfllamarl import AsyncAIPOConfig

    fields = dict(logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                  bootstrap_generation=False, generator_dtype="float32")
    fields.update(config)
    args = AsyncAIPOConfig(**fields)
    args.topology.samples_in_process = True  # (no generator child is started, not even ahead of the job)
    try:
        return _train(model_path, rows, reward_funcs, args, quiet)
    finally:
        args.topology.samples_in_process = False


def _train(model_path, rows, reward_funcs, args, quiet: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from hfllamarl import AsyncAIPOTrainer
    from hfllamarl.runtime.loop.rollout import ROLLOUTS
    from hfllamarl.runtime.training.bootstrap import BootstrapSampler
    from hfllamarl.runtime.weights.lookahead import sampling_weights
    from hfllamarl.trainers.trainer_ranks import build_trainer_executor

    staleness = args.max_staleness
    iterations = max(1, args.num_iterations)
    out = io.StringIO()
    with contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext():
        trainer = AsyncAIPOTrainer(model=model_path, reward_funcs=reward_funcs, args=args,
                                   train_dataset=Dataset.from_list(rows))
        topo = trainer.topology
        topo.new_job()
        topo.init_local_world()
        spec = trainer._generator_spec()
        executor = build_trainer_executor(trainer, None)
        executor.prepare()
        behaviour = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        sampler = BootstrapSampler(behaviour, trainer.processing_class, trainer.train_dataset, spec,
                                   executor.spec.device, generation_config=getattr(trainer.model, "generation_config",
                                                                                   None))
        versions = deque([(0, snapshot(trainer.model))])  # the policies a later batch is still sampled with
        start = time.perf_counter()
        for batch in range(trainer.schedule.num_batches):
            wanted = max(0, batch - staleness) * trainer.schedule.iterations  # (num_iterations: versions per batch)
            while versions[0][0] < wanted:
                versions.popleft()
            version, weights = versions[0]
            behaviour.load_state_dict(weights)
            groups = sampler.sample(batch, version)
            if groups is None:
                raise ValueError(f"a prompt of batch {batch} leaves no room for max_completion_length tokens")
            executor.set_step(batch + staleness)  # the tick that trains this batch in the runtime's schedule
            executor.put_input(ROLLOUTS, groups)
            executor.step()
            # (sampler_lookahead: the weights the runtime would send for the batch sampled with this version)
            sent, _ = sampling_weights(executor.spec, trainer.model, executor.version // iterations + staleness,
                                       executor.version)
            versions.append((executor.version, snapshot(sent)))
            if executor.spec.should_stop():
                break
        seconds = time.perf_counter() - start
        executor.close()
        trainer._reporter.train_end()
    series = {name: [] for name in SERIES}
    for entry in trainer.state.log_history:
        if "reward" not in entry:
            continue
        for name in SERIES:
            series[name].append(float(entry[name]) if name in entry else None)
    return {"series": {k: v for k, v in series.items() if any(x is not None for x in v)}, "seconds": seconds}
