"""Start-up checks of the sampling fields and `generation_kwargs` (what vLLM may be told, and what the trainer sets
itself), for `AsyncAIPOConfig`: the generator and the trainer's pi must sample from one distribution."""

from __future__ import annotations

import math

from hfllamarl.runtime.loop.sampling import NEUTRAL_KWARGS, TRANSFORM_KWARGS

# generation_kwargs the trainer sets itself, with what to set instead.
_SET_BY_TRAINER = {
    "n": "the group size is num_generations",
    "max_tokens": "the completion length is max_completion_length",
    "logprobs": "the generator asks vLLM for the sampled token's log-prob itself",
    "prompt_logprobs": "the generator asks vLLM for the sampled token's log-prob itself",
    "min_tokens": "it masks the end-of-sequence token for the first tokens, which the trainer's pi does not follow",
    "truncate_prompt_tokens": "the prompts are validated against the context instead (a truncated prompt would "
                              "differ from the one the trainer scores)",
}


def check_sampling(config) -> None:
    """generation_kwargs (a JSON string from a command line or recipe is parsed in place) and the sampling fields:
    only transforms both the generator and the trainer's pi apply, and values in range."""
    if isinstance(config.generation_kwargs, str):  # from a command line or a YAML recipe
        import json

        config.generation_kwargs = json.loads(config.generation_kwargs)
    kw = config.generation_kwargs or {}
    if not isinstance(kw, dict):
        raise ValueError(f"AsyncAIPOConfig: generation_kwargs must be a dict of vLLM SamplingParams, got "
                         f"{type(kw).__name__}.")
    for key in kw:
        if key in NEUTRAL_KWARGS or key in TRANSFORM_KWARGS:
            continue
        why = _SET_BY_TRAINER.get(key, "it changes which tokens can be sampled in a way the trainer's pi does not "
                                       "follow, so pi/mu would not be 1 even on-policy")
        raise ValueError(f"AsyncAIPOConfig: generation_kwargs[{key!r}] is not supported: {why}. Supported: the "
                         f"sampling transforms {sorted(TRANSFORM_KWARGS)} (applied by both the generator and the "
                         f"trainer) and {sorted(NEUTRAL_KWARGS)}.")
    s = config.sampling
    checks = [
        (math.isfinite(s.temperature) and s.temperature > 0, f"temperature={s.temperature}: it must be > 0 (RL "
         "samples; a greedy generator has no distribution to correct)"),
        (0 < s.top_p <= 1, f"top_p={s.top_p}: it must be in (0, 1]"),
        (0 <= s.min_p <= 1, f"min_p={s.min_p}: it must be in [0, 1]"),
        (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0,
         f"repetition_penalty={s.repetition_penalty}: it must be > 0"),
        (math.isfinite(s.presence_penalty) and math.isfinite(s.frequency_penalty),
         "presence_penalty and frequency_penalty must be finite"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"AsyncAIPOConfig: {message}.")
