"""The trainer's micro-batch: rollouts -> model inputs, and log pi of every completion token.

Two layouts of the same sequences (prompt + completion) give the same log-probs:

- packed (`padding_free=True`, the default): sequences are laid end to end in rows as wide as the longest
  one, longest first, each into the first row it fits (first-fit decreasing). Position ids restart at 0 for
  every sequence, and transformers' attention masks keep each sequence to itself (a block-diagonal causal
  mask found from the position ids, or varlen flash attention on a GPU). Only the tail of a row is padding,
  so short completions no longer cost as much as the longest one.
- padded: prompts left-padded, completions right-padded, one sequence per row `[B, P + T]`.

(A third, packed with each group's prompt computed once where it pays, is `shared_prompts.share_batch`; which
layout a micro-batch gets is `shared_prompts.Layout`'s choice.)

Either way the lm head runs only at the positions that predict a completion token (a forward pre-hook picks
those rows of the hidden states), and pi is `x[token] - logsumexp(x)` there, so neither the prompt's logits
nor a `[B, T, V]` log-softmax is ever made. Whether a model's attention follows position-id packing is checked
once on the real model (`packing_agrees`); one that does not trains padded.

The loss side is the same for both: `[B, T]` tensors (completion ids, mask, behaviour log-probs), completion
token t of sample b at `[b, t]`.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.training import vocab_parallel
from hfllamarl.runtime.loop.sampling import Sampling, processed_logits, seen_tokens

logger = logging.getLogger(__name__)


def _round_up(n: int, multiple: int | None) -> int:
    return -(-n // multiple) * multiple if multiple else n


def loss_side(rollouts: list[Rollout], pad_id: int) -> dict[str, torch.Tensor]:
    """`[B, T]` completion ids, mask and behaviour log-probs, and `[B, P]` prompt ids and mask (penalties)."""
    B = len(rollouts)
    T = max(max(len(r.completion_ids) for r in rollouts), 1)
    P = max(len(r.prompt_ids) for r in rollouts)
    completion_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    mu = torch.zeros((B, T), dtype=torch.float32)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    for i, r in enumerate(rollouts):
        if not r.prompt_ids:
            raise ValueError(f"a rollout of dataset row {r.row_index} has an empty prompt: no position predicts its "
                             "first completion token")
        p, c = len(r.prompt_ids), len(r.completion_ids)
        prompt_ids[i, :p] = torch.tensor(r.prompt_ids)
        prompt_mask[i, :p] = 1
        if c:
            completion_ids[i, :c] = torch.tensor(r.completion_ids)
            # the loss mask: every sampled token; tool/environment tokens (env_mask 0) are context only
            mask[i, :c] = 1.0 if r.env_mask is None else torch.tensor(r.env_mask, dtype=torch.float32)
            mu[i, :c] = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
    return dict(completion_ids=completion_ids, mask=mask, behavior_logprobs=mu, prompt_ids=prompt_ids,
                prompt_mask=prompt_mask)


def _targets(rollouts: list[Rollout], starts: list[int], T: int) -> torch.Tensor:
    """`[B, T]`: for each completion token, the flat index (over the model input's rows x columns) of the position
    whose logits predict it (0 past the completion's end); `starts[i]` is where sample i's first completion token
    sits."""
    targets = torch.zeros((len(rollouts), T), dtype=torch.long)
    for i, (r, start) in enumerate(zip(rollouts, starts)):
        c = len(r.completion_ids)
        if c:
            targets[i, :c] = torch.arange(start - 1, start - 1 + c)
    return targets


def pad_batch(rollouts: list[Rollout], pad_id: int, device, multiple_of: int | None = None) -> dict:
    """One sequence per row: prompts left-padded and completions right-padded, so every completion starts at
    the same column. Returns input_ids / attention_mask / position_ids `[B, W]` (W = P + T, rounded up to
    `multiple_of`), token_mask (the attention mask: 1 at real tokens), `targets` `[B, T]` and the loss side
    (`loss_side`)."""
    out = loss_side(rollouts, pad_id)
    B, T = out["completion_ids"].shape
    P = out["prompt_ids"].shape[1]
    W = _round_up(P + T, multiple_of)
    input_ids = torch.full((B, W), pad_id, dtype=torch.long)
    attn = torch.zeros((B, W), dtype=torch.long)
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, P - p:P + c] = torch.tensor(r.prompt_ids + r.completion_ids)
        attn[i, P - p:P + c] = 1
    position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)
    out.update(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, token_mask=attn,
               targets=_targets(rollouts, [i * W + P for i in range(B)], T))
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in out.items()}


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: the indices of `lengths` in rows of at most `width` (longest first, each into the
    first row with room; ties keep their order, so the packing is deterministic)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for row, free in enumerate(room):
            if lengths[i] <= free:
                rows[row].append(i)
                room[row] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def pack_batch(rollouts: list[Rollout], pad_id: int, device, multiple_of: int | None = None) -> dict:
    """Sequences end to end in rows of width W (the longest sequence, rounded up to `multiple_of`), position ids
    restarting at 0 for each; a row's tail is padding, numbered as a sequence of its own so that it attends to
    nothing real. No attention mask: transformers finds the sequences from the position ids. Same keys as
    `pad_batch` (attention_mask None; token_mask `[rows, W]` marks the real tokens)."""
    out = loss_side(rollouts, pad_id)
    T = out["completion_ids"].shape[1]
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    W = _round_up(max(lengths), multiple_of)
    rows = pack_rows(lengths, W)
    input_ids = torch.full((len(rows), W), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), W), dtype=torch.long)
    token_mask = torch.zeros((len(rows), W), dtype=torch.long)
    starts = [0] * len(rollouts)
    for row, members in enumerate(rows):
        col = 0
        for i in members:
            r, n = rollouts[i], lengths[i]
            input_ids[row, col:col + n] = torch.tensor(r.prompt_ids + r.completion_ids)
            position_ids[row, col:col + n] = torch.arange(n)
            starts[i] = row * W + col + len(r.prompt_ids)
            col += n
        position_ids[row, col:] = torch.arange(W - col)
        token_mask[row, :col] = 1
    out.update(input_ids=input_ids, attention_mask=None, position_ids=position_ids, token_mask=token_mask,
               targets=_targets(rollouts, starts, T))
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in out.items()}


@contextlib.contextmanager
def _lm_head_at(model, positions: torch.Tensor):
    """While active, the model's output layer sees only the hidden states at `positions` (flat indices over the
    input's rows x columns), as one row `[1, N, H]`. Yields a dict whose "fired" says whether it did (a model
    that computes its logits without its output embeddings module is left alone)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    state = {"fired": False}
    if head is None:
        yield state
        return

    def pick(module, args):
        hidden = args[0]
        state["fired"] = True
        return (hidden.reshape(-1, hidden.shape[-1])[positions].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(pick, prepend=True)  # (before a tensor-parallel plan's own hook)
    try:
        yield state
    finally:
        handle.remove()


def completion_logprobs(model, batch: dict, sampling: Sampling | float, entropy: bool = False,
                        router_logits: list | None = None):
    """log pi of every completion token, `[B, T]` (0 past each completion's end), under the distribution vLLM
    samples from (`sampling`: its transforms, or just a temperature). With `entropy`, also that distribution's
    entropy at every completion position, `[B, T]`, without gradient (TRL's `entropy` metric). Given a list as
    `router_logits`, the forward also records an MoE model's routers' logits into it (one tensor per layer, over
    the input's rows x columns: `hfllamarl.runtime.training.moe`)."""
    if not isinstance(sampling, Sampling):
        sampling = Sampling(temperature=float(sampling))
    tokens = batch["completion_ids"]  # [B, T]
    where = (batch["mask"] > 0).nonzero(as_tuple=True)  # the N completion tokens the loss sees, sample-major
    positions = batch["targets"][where]  # [N]
    B, T = tokens.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=tokens.device)
    empty = positions.numel() == 0
    if empty:  # the forward still runs (FSDP2's collectives must match on every rank): one position, weighed 0
        positions = batch["targets"].new_zeros(1)
    routers = {} if router_logits is None else {"output_router_logits": True}
    with _lm_head_at(model, positions) as head:
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=batch["position_ids"], use_cache=False, **routers)
    logits = outputs.logits
    if routers:
        router_logits.extend(outputs.router_logits)
    if vocab_parallel.is_sharded(logits):
        if sampling.temperature_only:  # trainer tensor parallelism: log-probs on the vocabulary shards
            return _sharded_logprobs(logits, head["fired"], positions, tokens, where, out, sampling, entropy, empty)
        logits = logits.full_tensor()  # top-k/top-p/min-p/penalties transform the whole distribution
    logits = logits.reshape(-1, logits.shape[-1])
    if not head["fired"]:
        logits = logits[positions]
    x = logits.float()  # [N, V]
    if empty:
        return (out + 0.0 * x.sum(), out.detach().clone()) if entropy else out + 0.0 * x.sum()
    if sampling.temperature_only:
        x = x / sampling.temperature
    else:
        seen = None
        if sampling.penalties:
            in_prompt, in_output, count = seen_tokens(batch["prompt_ids"], batch["prompt_mask"], tokens, x.shape[-1])
            seen = (in_prompt[where[0], 0], in_output[where], count[where])  # each [N, V]
        x = processed_logits(x, sampling, seen)
    logprobs = x.gather(-1, tokens[where].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)  # [N]
    if not entropy:
        return out.index_put(where, logprobs)
    return out.index_put(where, logprobs), out.detach().index_put(where, _entropy(x.detach()))


def _sharded_logprobs(logits, fired: bool, positions, tokens, where, out, sampling: Sampling, entropy: bool,
                      empty: bool):
    """`completion_logprobs` on vocabulary-sharded logits (`vocab_parallel`), temperature only."""
    local, start, group = vocab_parallel.shard_of(logits)
    local = local.reshape(-1, local.shape[-1])
    if not fired:
        local = local[positions]
    x = local.float() / sampling.temperature
    if empty:
        return (out + 0.0 * x.sum(), out.detach().clone()) if entropy else out + 0.0 * x.sum()
    logprobs = vocab_parallel.token_logprobs(x, start, tokens[where], group)
    if not entropy:
        return out.index_put(where, logprobs)
    return out.index_put(where, logprobs), out.detach().index_put(where, vocab_parallel.entropies(x.detach(), group))


def _entropy(x: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """`[N, V]` logits (masked tokens at -inf) -> `[N]` entropies, a chunk of rows at a time (one `[rows, V]`
    temporary, however long the batch)."""
    out = []
    for chunk in x.split(rows):
        logp = torch.log_softmax(chunk, dim=-1)
        out.append(-(logp.exp() * logp.masked_fill(torch.isneginf(logp), 0.0)).sum(-1))
    return torch.cat(out)


def layout_agrees(model, rollouts: list[Rollout], layout: dict, leaky: dict, device,
                  multiple_of: int | None = None) -> tuple[bool, float, float]:
    """Whether the micro-batch `layout` of two `rollouts` gives the log-probs of the same sequences padded, judged
    against the difference a leak makes (`leaky`: the same inputs where the second sequence sees the first), so
    that kernel noise in bf16 does not count as a leak. Returns (agrees, the error, the leak's size)."""
    sampling = Sampling()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            reference = completion_logprobs(model, pad_batch(rollouts, 0, device, multiple_of), sampling)
            good = completion_logprobs(model, layout, sampling)
            leak = completion_logprobs(model, leaky, sampling)
    finally:
        model.train(was_training)
    error = float((good - reference).abs().max())
    leak_size = float((leak - reference)[1].abs().max())
    return error <= max(1e-5, 0.05 * leak_size), error, leak_size


def packing_agrees(model, vocab_size: int, device, multiple_of: int | None = None) -> bool:
    """Whether `model` computes the same log-probs packed as padded: its attention keeps packed sequences apart
    when told only by the position ids. Decided against the difference that leaking across sequences makes (the
    same packed row with positions that do not restart), so that kernel noise in bf16 does not count as a leak.
    Every trainer rank calls it at the same point (FSDP2 gathers weights in the forward). `multiple_of`: the widths
    the model takes (sequence parallelism: a multiple of the tensor-parallel group)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (14,), generator=g).tolist()
    rollouts = [Rollout(prompt="", prompt_ids=ids[:4], completion_ids=ids[4:9], behavior_logprobs=[0.0] * 5,
                        versions=[0] * 5, finish_reason="stop", completion_text=""),
                Rollout(prompt="", prompt_ids=ids[9:11], completion_ids=ids[11:], behavior_logprobs=[0.0] * 3,
                        versions=[0] * 3, finish_reason="stop", completion_text="")]
    width = math.lcm(14, multiple_of or 1)
    packed = pack_batch(rollouts, 0, device, multiple_of=width)  # one row: 9 tokens, then 5 (then padding)
    leaky = dict(packed, position_ids=torch.arange(width, device=device).unsqueeze(0))  # the second sees the first
    agrees, error, leak_size = layout_agrees(model, rollouts, packed, leaky, device, multiple_of)
    if not agrees:
        logger.warning("padding-free packing is off: this model's attention does not keep packed sequences apart "
                       "by position ids (log-prob error %.3g, leak %.3g); micro-batches are padded instead.",
                       error, leak_size)
    return agrees
