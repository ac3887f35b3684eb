"""A group's shared prompt computed once in the trainer's forward and backward pass (`share_prompts=True`).

The `num_generations` completions of one prompt all start with the same prompt tokens. Laid out as separate
sequences (`batching.pack_batch`), the prompt is computed once per completion, forward and backward; with a long
prompt (a few-shot math prompt, a system prompt with tools) that is most of the step's work. Here a prompt copy is
followed by `k` of its completions in one packed run of tokens: each completion attends to the prompt and to its own
earlier tokens only (a 4-D attention mask, one `[W, W]` block-diagonal pattern per row), its position ids continue
from the prompt's end, and the prompt's last position predicts every completion's first token. The log-probs are
those of the separate sequences (checked once on the real model: `sharing_agrees`); the prompt's activations
receive the gradients of all `k` completions, as the separate sequences' copies did in sum.

It pays where the prompt tokens saved outweigh the wider rows: attention over a row of width W costs ~W^2 (on a CPU,
and with a GPU's SDPA kernels, a masked row computes every pair), the model's linear layers ~one pass per token.
`PromptSharing.choose` estimates both for `k` = 1 (the packed layout: nothing shared), 2, 4, ... up to the group
size, from the model's own shapes, and takes the cheapest; it says 1 where sharing would not pay (short prompts,
or a unit so long that its attention outweighs the tokens saved). Off where the attention implementation takes no
4-D mask (flash attention, flex attention), where a sequence is longer than the model's sliding window (the custom
mask would not apply it), and with the MoE load-balancing loss (its token count would change).
"""

from __future__ import annotations

import logging
import math

import torch

from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.training.attention import NAME as ATTENTION
from hfllamarl.runtime.training.batching import (loss_side, _round_up, layout_agrees, pack_batch, pack_rows,
                                                 packing_agrees, pad_batch)

logger = logging.getLogger(__name__)

MASKS = {"sdpa": "bool", "eager": "float", ATTENTION: "bool"}  # attention implementations taking a 4-D mask: its kind


def prompt_units(rollouts: list[Rollout], per_copy: int) -> list[list[int]]:
    """The rollouts (indices) laid after one prompt copy each: rollouts with the same prompt ids, in the order first
    seen, in runs of at most `per_copy` (1: every rollout on its own)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rollouts):
        by_prompt.setdefault(tuple(r.prompt_ids), []).append(i)
    per_copy = max(int(per_copy), 1)
    return [same[j:j + per_copy] for same in by_prompt.values() for j in range(0, len(same), per_copy)]


def _unit_length(rollouts: list[Rollout], unit: list[int]) -> int:
    return len(rollouts[unit[0]].prompt_ids) + sum(len(rollouts[i].completion_ids) for i in unit)


def share_batch(rollouts: list[Rollout], pad_id: int, device, per_copy: int, mask: str = "bool",
                multiple_of: int | None = None) -> dict:
    """The micro-batch with each prompt copy followed by up to `per_copy` of its completions (`prompt_units`), the
    units packed first-fit decreasing into rows as wide as the longest unit (rounded up to `multiple_of`). Same keys
    as `batching.pack_batch`; `attention_mask` is `[rows, 1, W, W]`: bool (True: attend) for `mask="bool"`, else
    float (0 or the dtype's minimum, added to the scores). Each row's padding tail attends to itself only."""
    out = loss_side(rollouts, pad_id)
    T = out["completion_ids"].shape[1]
    units = prompt_units(rollouts, per_copy)
    lengths = [_unit_length(rollouts, u) for u in units]
    W = _round_up(max(lengths), multiple_of)
    rows = pack_rows(lengths, W)
    input_ids = torch.full((len(rows), W), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), W), dtype=torch.long)
    token_mask = torch.zeros((len(rows), W), dtype=torch.long)
    attend = torch.zeros((len(rows), 1, W, W), dtype=torch.bool)
    targets = torch.zeros((len(rollouts), T), dtype=torch.long)
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    for row, members in enumerate(rows):
        col = 0
        for u in members:
            prompt = rollouts[units[u][0]].prompt_ids
            p = len(prompt)
            input_ids[row, col:col + p] = torch.tensor(prompt)
            position_ids[row, col:col + p] = torch.arange(p)
            attend[row, 0, col:col + p, col:col + p] = causal[:p, :p]
            start = col + p
            for i in units[u]:
                c = len(rollouts[i].completion_ids)
                if not c:
                    continue
                input_ids[row, start:start + c] = torch.tensor(rollouts[i].completion_ids)
                position_ids[row, start:start + c] = torch.arange(p, p + c)
                attend[row, 0, start:start + c, col:col + p] = True  # the prompt
                attend[row, 0, start:start + c, start:start + c] = causal[:c, :c]  # its own earlier tokens
                # the prompt's last position predicts the first token, then each token the next
                targets[i, :c] = torch.cat([torch.tensor([row * W + col + p - 1]),
                                            torch.arange(row * W + start, row * W + start + c - 1)])
                start += c
            col = start
        token_mask[row, :col] = 1
        position_ids[row, col:] = torch.arange(W - col)
        tail = torch.arange(col, W)
        attend[row, 0, tail, tail] = True  # (the tail: no row of the mask is empty)
    if mask == "bool":
        attention = attend
    else:
        attention = torch.zeros(attend.shape, dtype=torch.float32).masked_fill_(~attend, torch.finfo(torch.float32).min)
    out.update(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, token_mask=token_mask,
               targets=targets)
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in out.items()}


class PromptSharing:
    """Whether, and how many completions per prompt copy, a micro-batch is laid out with (`choose`), from the model's
    shapes: the linear layers' parameters (one multiply-add each a token) against attention's `d x W^2` a row and
    layer. Build with `for_model`; None there means the model cannot share prompts (see the module docstring)."""

    def __init__(self, linear_params: int, attention_width: int, layers: int, mask: str,
                 sliding_window: int | None = None, multiple_of: int | None = None):
        self.linear_params, self.attention_width, self.layers = linear_params, attention_width, layers
        self.mask, self.sliding_window, self.multiple_of = mask, sliding_window, multiple_of

    @classmethod
    def for_model(cls, model, multiple_of: int | None = None) -> "PromptSharing | None":
        config = getattr(model, "config", None)
        kind = MASKS.get(getattr(config, "_attn_implementation", None) or "")
        if config is None or kind is None:
            return None
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads, hidden = getattr(text, "num_attention_heads", None), getattr(text, "hidden_size", None)
        layers = getattr(text, "num_hidden_layers", None)
        if not (heads and hidden and layers):
            return None
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        embeddings = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
                      if m is not None and getattr(m, "weight", None) is not None}
        linear = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
        window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) is not False else None
        return cls(linear, heads * head_dim, int(layers), kind, window, multiple_of)

    def cost(self, rollouts: list[Rollout], per_copy: int) -> float:
        """Multiply-adds of one forward over the micro-batch laid out with `per_copy` completions a prompt copy."""
        lengths = [_unit_length(rollouts, u) for u in prompt_units(rollouts, per_copy)]
        W = _round_up(max(lengths), self.multiple_of)
        rows = len(pack_rows(lengths, W))
        return sum(lengths) * self.linear_params + 2.0 * rows * W * W * self.attention_width * self.layers

    def choose(self, rollouts: list[Rollout]) -> int:
        """Completions per prompt copy for this micro-batch: the cheapest of 1, 2, 4, ... and the largest group;
        1 (nothing shared) when no prompt repeats or a sequence is longer than the sliding window."""
        group = max((len(u) for u in prompt_units(rollouts, len(rollouts))), default=1)
        longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
        if group < 2 or (self.sliding_window and longest > self.sliding_window):
            return 1
        candidates = sorted({min(2 ** j, group) for j in range(int(math.log2(group)) + 2)})
        return min(candidates, key=lambda k: (self.cost(rollouts, k), k))


def sharing_agrees(model, sharing: PromptSharing, vocab_size: int, device) -> bool:
    """Whether `model` computes the same log-probs with a shared prompt as with separate padded sequences
    (`batching.layout_agrees`; the leak: the second completion allowed to see the first). Every trainer rank calls
    it at the same point (FSDP2 gathers weights in the forward)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (13,), generator=g).tolist()
    rollouts = [Rollout(prompt="", prompt_ids=ids[:5], completion_ids=ids[5:9], behavior_logprobs=[0.0] * 4,
                        versions=[0] * 4, finish_reason="stop", completion_text=""),
                Rollout(prompt="", prompt_ids=ids[:5], completion_ids=ids[9:], behavior_logprobs=[0.0] * 4,
                        versions=[0] * 4, finish_reason="stop", completion_text="")]
    shared = share_batch(rollouts, 0, device, 2, sharing.mask, sharing.multiple_of)
    leaky_mask = shared["attention_mask"].clone()
    leaky_mask[..., 9:13, 5:9] = True if sharing.mask == "bool" else 0.0  # the second completion sees the first
    agrees, error, leak_size = layout_agrees(model, rollouts, shared, dict(shared, attention_mask=leaky_mask), device,
                                             sharing.multiple_of)
    if not agrees:
        logger.warning("share_prompts is off: this model's attention does not follow a 4-D attention mask (log-prob "
                       "error %.3g, leak %.3g); each completion carries its own copy of the prompt.", error, leak_size)
    return agrees


class Layout:
    """How the trainer lays out each micro-batch (`build`): padded, packed (`padding_free`), or packed with each
    group's prompt computed once where it pays (`share_prompts`). `checked` decides on the real model."""

    def __init__(self, spec, packed: bool = False, sharing: PromptSharing | None = None):
        self.spec, self.packed, self.sharing = spec, packed, sharing

    @classmethod
    def checked(cls, spec, balancing=None) -> "Layout":
        """Every trainer rank at the same point (the probes' forwards gather FSDP2 weights): packing if the model's
        attention follows position ids, and prompt sharing if it also follows a 4-D mask and nothing rules it out
        (the MoE load-balancing loss, sequence parallelism's widths)."""
        model = spec.model
        packed = bool(spec.padding_free) and packing_agrees(model, model.config.vocab_size, spec.device,
                                                            spec.pad_to_multiple_of)
        sharing = None
        if packed and spec.share_prompts and balancing is None and spec.pad_to_multiple_of is None:
            sharing = PromptSharing.for_model(model)
            if sharing is None:
                logger.info("share_prompts is off: attention implementation %r takes no 4-D attention mask",
                            getattr(model.config, "_attn_implementation", None))
            elif not sharing_agrees(model, sharing, model.config.vocab_size, spec.device):
                sharing = None
        return cls(spec, packed, sharing)

    def build(self, rollouts: list[Rollout]) -> dict:
        """The micro-batch's model inputs and loss side (`batching.pack_batch`'s keys), plus `tokens_saved_frac`: the
        share of the separate sequences' tokens not computed (prompt copies left out)."""
        spec = self.spec
        per_copy = self.sharing.choose(rollouts) if self.sharing is not None else 1
        if per_copy > 1:
            batch = share_batch(rollouts, spec.pad_token_id, spec.device, per_copy, self.sharing.mask,
                                spec.pad_to_multiple_of)
        else:
            build = pack_batch if self.packed else pad_batch
            batch = build(rollouts, spec.pad_token_id, spec.device, spec.pad_to_multiple_of)
        separate = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
        batch["tokens_saved_frac"] = 1.0 - float(batch["token_mask"].sum()) / max(separate, 1)
        return batch
