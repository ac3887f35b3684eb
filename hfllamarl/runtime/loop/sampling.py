"""The sampling distribution, the same on both sides: what vLLM samples from, and pi as the trainer computes it.

vLLM reports for each sampled token its log-probability under the distribution it actually sampled
from (`logprobs_mode="processed_logprobs"`): the logits after the penalties, divided by the
temperature, then masked by min-p, top-k and top-p. The trainer computes pi through exactly the same
steps, in the same order (vLLM v1's `Sampler`), so that an on-policy token has pi/mu == 1 whatever
the user sets:

1. penalties, on the raw logits: repetition (a token seen in the prompt or earlier in the completion
   has its logit divided by the penalty when positive, multiplied by it otherwise), then frequency
   (minus the penalty times the token's count so far in the completion) and presence (minus the
   penalty once the token appeared in the completion);
2. temperature: logits / T;
3. min-p: tokens whose probability is below `min_p` times the most likely token's are masked;
4. top-k, then top-p over what is left (the smallest set of most likely tokens whose probability
   reaches `top_p`; the most likely token always stays);
5. log-softmax over the survivors.

Masks and the penalty's branch are decided on detached values; gradient flows through the kept logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# generation_kwargs that leave the sampled distribution alone (vLLM SamplingParams names).
NEUTRAL_KWARGS = {"stop", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                  "spaces_between_special_tokens", "ignore_eos", "seed", "detokenize"}
# generation_kwargs that change the distribution and that both sides apply (the config's fields).
TRANSFORM_KWARGS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty"}


@dataclass(frozen=True)
class Sampling:
    """The sampling transforms of a job, as vLLM's `SamplingParams` names them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def truncates(self) -> bool:
        """Whether some tokens get probability 0 (top-k, top-p, min-p)."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    @property
    def temperature_only(self) -> bool:
        """Whether pi is just a tempered softmax (the fast path)."""
        return not self.penalties and self.top_p >= 1.0 and self.top_k <= 0 and self.min_p <= 0.0

    def vllm_kwargs(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k if self.top_k > 0 else -1,
                "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty}


def seen_tokens(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each completion position t (what predicts completion token t): which tokens the prompt holds,
    which the completion held before t, and how many times.

    Returns `in_prompt [B, 1, V]`, `in_output [B, T, V]` (bool) and `count [B, T, V]` (float).
    """
    B, T = completion_ids.shape
    # Summed, not written: a padding position must not clear a token the prompt holds (scatter_'s order is undefined).
    in_prompt = torch.zeros(B, vocab, device=prompt_ids.device).scatter_add_(
        1, prompt_ids.clamp(0, vocab - 1), prompt_mask.float()) > 0
    one_hot = torch.zeros(B, T, vocab, device=completion_ids.device)
    one_hot.scatter_(2, completion_ids.clamp(0, vocab - 1).unsqueeze(-1), 1.0)
    count = torch.cumsum(one_hot, dim=1) - one_hot  # tokens strictly before t
    return in_prompt.unsqueeze(1), count > 0, count


def processed_logits(logits: torch.Tensor, sampling: Sampling, seen=None) -> torch.Tensor:
    """`[B, T, V]` float32 logits -> the logits vLLM samples from (masked tokens at -inf). `seen`: from
    `seen_tokens`, needed only with penalties."""
    x = logits.float()
    if sampling.penalties:
        in_prompt, in_output, count = seen
        if sampling.repetition_penalty != 1.0:
            rp = torch.tensor(sampling.repetition_penalty, dtype=torch.float32)  # float32 arithmetic, as vLLM's
            scale = torch.where(x.detach() > 0, 1.0 / rp, rp)
            x = torch.where(in_prompt | in_output, x * scale, x)
        if sampling.frequency_penalty:
            x = x - sampling.frequency_penalty * count
        if sampling.presence_penalty:
            x = x - sampling.presence_penalty * in_output.float()
    x = x / sampling.temperature
    drop = torch.zeros_like(x, dtype=torch.bool)
    with torch.no_grad():
        if sampling.min_p > 0:
            probs = torch.softmax(x, dim=-1)
            drop |= probs < probs.amax(dim=-1, keepdim=True) * torch.tensor(sampling.min_p, dtype=torch.float32)
        if sampling.top_k > 0 or sampling.top_p < 1.0:
            kept = x.masked_fill(drop, float("-inf"))
            if sampling.top_k > 0 and sampling.top_k < x.shape[-1]:
                kth = kept.topk(sampling.top_k, dim=-1).values[..., -1:]
                drop |= kept < kth
                kept = kept.masked_fill(drop, float("-inf"))
            if sampling.top_p < 1.0:
                ordered, order = kept.sort(dim=-1, descending=False)
                cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
                out = cumulative <= 1 - torch.tensor(sampling.top_p, dtype=torch.float32)
                out[..., -1] = False  # the most likely token always stays
                drop |= torch.zeros_like(out).scatter(-1, order, out)
    return x.masked_fill(drop, float("-inf"))


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling, seen=None) -> torch.Tensor:
    """log-probability of `tokens [B, T]` under the processed distribution of `logits [B, T, V]`."""
    if sampling.temperature_only:
        x = logits.float() / sampling.temperature
    else:
        x = processed_logits(logits, sampling, seen)
    return torch.log_softmax(x, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


OUTSIDE_LOGPROB = -1e4  # what a sampled token outside the current policy's support counts as: pi ~ 0, weight 0


def within_support(logprobs: torch.Tensor, mask: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs [B, T]` ready for a loss: padding positions 0, and under truncation (top-k, top-p, min-p) a
    sampled token the *current* policy can no longer sample (possible only off-policy: its log-prob is -inf)
    set to `OUTSIDE_LOGPROB` without gradient, so that its importance weight is 0 instead of NaN. Returns the
    logprobs and the mask of those tokens."""
    real = mask.bool()
    outside = real & torch.isneginf(logprobs.detach()) if sampling.truncates else torch.zeros_like(real)
    safe = torch.where(real & ~outside, logprobs, torch.zeros_like(logprobs))
    return torch.where(outside, torch.full_like(safe, OUTSIDE_LOGPROB), safe), outside
