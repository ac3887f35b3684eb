"""Start-up checks of the fields that shape what the generator samples with and when: partial rollouts
(`partial_rollout_tokens`, how many ticks a batch spans) and the sampler's lookahead (`sampler_lookahead`,
`hfllamarl.runtime.weights.lookahead`). The schedule they set is `hfllamarl.runtime.loop.schedule`'s."""

from __future__ import annotations

LOOKAHEAD = ("none", "adamw")


def check_partial_rollouts(config) -> None:
    """partial_rollout_tokens: a whole budget, carried within the staleness bound, and no generation_kwargs that
    act on one tick's segment only."""
    budget = config.partial_rollout_tokens
    if budget is None:
        return
    if not (isinstance(budget, int) and not isinstance(budget, bool)) or budget < 1:
        raise ValueError(f"AsyncAIPOConfig: partial_rollout_tokens={budget!r}; it must be a whole number of "
                         "tokens >= 1, or None (no partial rollouts).")
    ticks = config.generation_ticks
    if ticks > max(config.max_staleness, 1):
        need = -(-config.max_completion_length // max(config.max_staleness, 1))
        raise ValueError(
            f"AsyncAIPOConfig: partial_rollout_tokens={budget} splits a completion of max_completion_length="
            f"{config.max_completion_length} over up to {ticks} ticks, but a batch must reach the trainer within "
            f"max_staleness={config.max_staleness} tick(s) (the staleness bound). Raise max_staleness to >= {ticks}"
            + (f" or partial_rollout_tokens to >= {need}." if config.max_staleness >= 1 else
               " (partial rollouts need an asynchronous job).")
        )
    kwargs = config.generation_kwargs or {}
    per_segment = [k for k in ("stop", "min_tokens", "presence_penalty", "frequency_penalty") if kwargs.get(k)]
    if per_segment and ticks > 1:
        raise ValueError(
            f"AsyncAIPOConfig: generation_kwargs {per_segment} act on each tick's segment of a partial rollout, not on "
            "the whole completion (a stop string split between two ticks would be missed; penalties would not see "
            "the earlier tokens). Remove them, use stop_token_ids instead of stop, or set partial_rollout_tokens=None."
        )


def check_sampler_lookahead(config) -> None:
    """sampler_lookahead: one of LOOKAHEAD; 'adamw' only where there is something to look ahead to, and a batch is
    sampled by one version (LoRA is refused by the trainer, which knows the peft_config)."""
    value = config.sampler_lookahead
    if value not in LOOKAHEAD:
        raise ValueError(f"AsyncAIPOConfig: sampler_lookahead={value!r}; choose one of {', '.join(map(repr, LOOKAHEAD))}.")
    if value != "adamw":
        return
    if config.max_staleness == 0:
        raise ValueError("AsyncAIPOConfig: sampler_lookahead='adamw' with max_staleness=0: a synchronous job samples with "
                         "the weights it trains, so there is nothing to look ahead to. Remove sampler_lookahead or "
                         "raise max_staleness.")
    if config.generation_ticks > 1:
        raise ValueError("AsyncAIPOConfig: sampler_lookahead='adamw' with partial rollouts (partial_rollout_tokens="
                         f"{config.partial_rollout_tokens}): a carried completion continues under several versions, each "
                         "trained at another distance, so no one lookahead fits. Remove sampler_lookahead or "
                         "set partial_rollout_tokens=None.")


def check_head_start(config) -> None:
    """trainer_head_start: 'auto', 'off' or a number of tokens (normalised to text: a YAML recipe may give a number)."""
    from hfllamarl.runtime.training.head_start import tokens_of

    try:
        tokens_of(config.trainer_head_start)
    except ValueError as exc:
        raise ValueError(f"AsyncAIPOConfig: {exc}.") from None
    config.trainer_head_start = str(config.trainer_head_start).strip().lower()
