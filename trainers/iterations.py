"""Start-up checks of TRL's `num_iterations`, `top_entropy_quantile` and `sync_ref_model`.

How the runtime honours them (`hfllamarl.runtime.training.iterations`, `hfllamarl.runtime.loop.schedule`):

- `num_iterations = k`: each generation batch is trained k optimizer steps in one tick, every step one policy
  version. `max_steps`, `global_step`, the learning-rate schedule, `logging_steps`, `save_steps` and `eval_steps`
  count optimizer steps as in TRL. The weights reach the generator after a batch's last pass, and a checkpoint can
  only be written there (a batch trained half-way is not resumable), so a save or evaluation interval must be a
  multiple of k; anything else is refused here. The algorithm gets `old_logprobs` (the policy before the batch's
  first pass), so its loss must name that parameter.
- `top_entropy_quantile < 1`: the algorithm gets TRL's `entropy_mask`, so its loss must name that parameter.
- `sync_ref_model`: the reference model (beta > 0) is mixed toward the policy every `ref_model_sync_steps` optimizer
  steps; with LoRA there is no separate reference model (TRL refuses it too).
"""

from __future__ import annotations

import inspect
import math


def loss_params(algorithm) -> set[str]:
    """The parameter names of the algorithm's `loss`."""
    return set(inspect.signature(algorithm.loss).parameters)


def check_iteration_fields(args, algorithm) -> None:
    """Config-time checks (the values themselves, and whether the algorithm takes what they need)."""
    k, q = args.num_iterations, args.top_entropy_quantile
    if args.skip_flat_rows and not (getattr(algorithm, "rows_apart", False) and q >= 1.0):
        raise ValueError("AsyncAIPOConfig: skip_flat_rows=True needs a loss in which a row with advantage 0 adds "
                         "nothing and no row's term depends on another's (loss_type 'dapo' or 'cispo', beta=0, an "
                         "off_policy_correction that weighs each row on its own: not m2po or '+ess') and "
                         f"top_entropy_quantile=1 (here: algorithm {args.algorithm!r}, loss_type "
                         f"{getattr(algorithm, 'loss_type', None)!r}, beta {getattr(algorithm, 'beta', None)!r}, "
                         f"top_entropy_quantile {q}); leave it False.")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"AsyncAIPOConfig: num_iterations={k!r}; it must be a whole number >= 1 (optimizer passes "
                         "over each generation batch).")
    if not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
        raise ValueError(f"AsyncAIPOConfig: top_entropy_quantile={q!r}; it must be in [0, 1] (1: every token).")
    names = loss_params(algorithm)
    needs = {"old_logprobs": (k > 1, f"num_iterations={k} (it clips against the policy before the batch's first "
                                     "pass)"),
             "entropy_mask": (q < 1.0, f"top_entropy_quantile={q} (it masks the low-entropy tokens' loss)")}
    for param, (wanted, why) in needs.items():
        if wanted and param not in names:
            raise ValueError(f"AsyncAIPOConfig: {why}, but the algorithm {args.algorithm!r} has no `{param}` parameter "
                             "in its loss(), so it cannot honour it. Pick an algorithm that takes it, or remove the "
                             "setting.")
    if args.sync_ref_model:
        if args.beta == 0.0:
            raise ValueError("AsyncAIPOConfig: sync_ref_model=True while beta=0.0: no reference model is used, so there "
                             "is nothing to synchronize. Set sync_ref_model=False, or beta > 0.")
        alpha, every = args.ref_model_mixup_alpha, args.ref_model_sync_steps
        if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
            raise ValueError(f"AsyncAIPOConfig: ref_model_mixup_alpha={alpha!r}; it must be in [0, 1].")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"AsyncAIPOConfig: ref_model_sync_steps={every!r}; it must be a whole number >= 1.")


def check_iterations(args, schedule, steps_per_epoch: int, evaluates: bool, model_obj=None, peft_config=None) -> None:
    """Trainer-construction checks: intervals that must fall on batch boundaries, and LoRA with sync_ref_model."""
    from hfllamarl.runtime.weights.lora import is_peft

    from .trainer_ranks import eval_every, save_every

    k = schedule.iterations
    if args.sync_ref_model and (peft_config is not None or (model_obj is not None and is_peft(model_obj))):
        raise ValueError("AsyncAIPOTrainer: sync_ref_model=True with a LoRA policy: the reference is the base model "
                         "with the adapters off, so there is no separate reference model to synchronize (TRL refuses "
                         "it too). Use sync_ref_model=False, or full fine-tuning.")
    if k == 1:
        return
    intervals = {"save_steps": save_every(args, schedule.num_steps, steps_per_epoch)}
    if evaluates:
        intervals["eval_steps"] = eval_every(args, schedule.num_steps, steps_per_epoch)
    for name, every in intervals.items():
        if every and every % k:
            up = math.ceil(every / k) * k
            raise ValueError(
                f"AsyncAIPOTrainer: with num_iterations={k}, each generation batch is trained {k} optimizer steps in "
                f"one go and the policy is checkpointed and sent to the generator only after its last pass; a "
                f"{name.split('_')[0]} every {every} steps would fall inside a batch. Set {name} to a multiple of {k} "
                f"(e.g. {up}).")
