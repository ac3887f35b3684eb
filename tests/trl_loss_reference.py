"""TRL 1.16's own loss, called on tensors: the independent reference the loss tests compare against."""

import math
from collections import defaultdict
from types import SimpleNamespace

import torch


def trl_is_ratio(old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, args) -> torch.Tensor:
    """TRL's vLLM importance-sampling weight pi_old/mu, from its formula in `_generate_and_score_completions`."""
    d = (old - mu) * mask
    if args.vllm_importance_sampling_mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True)
    r = torch.exp(d)
    lo, hi = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if args.vllm_importance_sampling_mode.endswith("truncate"):
        return r.clamp(min=lo, max=hi)
    return r.masked_fill((r < (lo if lo is not None else -math.inf)) | (r > (hi if hi is not None else math.inf)), 0.0)


def trl_loss(logp, mu, mask, adv, options: dict, old=None, ref=None):
    """TRL 1.16's `GRPOTrainer._compute_loss` on these log-probs (one process, one micro-batch), using vLLM (so it
    applies its importance-sampling weight when the correction is on). `old`: TRL's old_per_token_logps (None:
    log pi detached, as with num_iterations=1); `ref`: the reference model's log-probs (beta > 0)."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none", **options)
    old = logp.detach() if old is None else old
    inputs = {}
    if args.vllm_importance_sampling_correction:
        inputs["importance_sampling_ratio"] = trl_is_ratio(old, mu, mask, args)
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    B, T = logp.shape
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros(B, T), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=args.off_policy_mask_threshold,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        importance_sampling_level=args.importance_sampling_level, beta=args.beta, args=args,
        loss_type=args.loss_type, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon, use_vllm=True,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                    reduce=lambda x, reduction="sum": x, sync_gradients=True),
        max_completion_length=args.max_completion_length, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)))
    inputs.update(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask.long(),
                  advantages=adv, old_per_token_logps=old, sampling_per_token_logps=mu, num_items_in_batch=mask.sum())
    return GRPOTrainer._compute_loss(fake, None, inputs)
