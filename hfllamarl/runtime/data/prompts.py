"""Prompts: which dataset rows make up each generation batch, and how a row becomes token ids.

Each epoch is a permutation of the dataset seeded by `(seed, epoch)`, cut into the E = N // P whole
batches of P prompts it fills (the rest of it is left out, as TRL's sampler drops a partial batch):
batch b is batch b % E of epoch b // E. (A dataset of fewer than P rows is an endless stream of its
epochs instead, P prompts a batch.) It depends on nothing but the seed, so any rank, a resumed job
included, can tell which prompts batch b holds.
"""

from __future__ import annotations

from typing import Any


def epoch_order(num_rows: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    import torch

    if not shuffle:
        return list(range(num_rows))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=g).tolist()


def batch_rows(num_rows: int, prompts_per_batch: int, batch_index: int, seed: int, shuffle: bool = True) -> list[int]:
    """Dataset row indices of generation batch `batch_index`."""
    if num_rows <= 0:
        raise ValueError("the training dataset is empty")
    per_epoch = num_rows // prompts_per_batch
    if per_epoch:
        epoch, k = divmod(batch_index, per_epoch)
        return epoch_order(num_rows, epoch, seed, shuffle)[k * prompts_per_batch:(k + 1) * prompts_per_batch]
    start = batch_index * prompts_per_batch
    out: list[int] = []
    cache: dict[int, list[int]] = {}
    for pos in range(start, start + prompts_per_batch):
        epoch, offset = divmod(pos, num_rows)
        if epoch not in cache:
            cache[epoch] = epoch_order(num_rows, epoch, seed, shuffle)
        out.append(cache[epoch][offset])
    return out


def group_batch_rows(num_rows: int, prompts_per_batch: int, batch_index: int, seed: int, shuffle: bool = True,
                     group: int = 0, groups: int = 1) -> list[int]:
    """Dataset row indices of trainer replica group `group`'s share of generation batch `batch_index`, when
    `groups` groups each train `prompts_per_batch` prompts a step (`trainer_replica_groups`): the batch of
    `groups * prompts_per_batch` prompts, cut into `groups` consecutive shares. One group: `batch_rows`."""
    rows = batch_rows(num_rows, prompts_per_batch * groups, batch_index, seed, shuffle)
    return rows[group * prompts_per_batch:(group + 1) * prompts_per_batch]


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


class PromptEncoder:
    """Turns a dataset row's `prompt` (text or chat messages) into token ids, as TRL does.

    `tools` (callables) are rendered into chat prompts as the template writes tool schemas; `chat_template`
    replaces the tokenizer's (TRL's training variant of it, for tool calling)."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None, tools: list | None = None,
                 chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if tools:  # `or None` in TRL's call: some templates (Llama) write tool boilerplate for an empty list
            self.chat_template_kwargs["tools"] = tools
        if chat_template is not None:
            self.chat_template_kwargs["chat_template"] = chat_template

    def render(self, prompt: Any) -> str:
        """The text the model reads for `prompt` (the chat template applied to chat messages)."""
        if is_conversational(prompt):
            return self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                      **self.chat_template_kwargs)
        return prompt

    def encode(self, prompt: Any) -> list[int]:
        if is_conversational(prompt):
            ids = self.tokenizer.apply_chat_template(
                prompt, tokenize=True, add_generation_prompt=True, **self.chat_template_kwargs
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])


def validate_dataset(dataset, encoder: PromptEncoder, max_completion_length: int, max_model_len: int) -> int:
    """Check every row before training starts; return the longest prompt in tokens.

    Raises:
        ValueError: a missing `prompt` column, an image column, an empty or malformed prompt, or a prompt that
            leaves no room for `max_completion_length` tokens; the message names the row.
    """
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            f"The data set is a {type(dataset).__name__} (streamed), which is not supported: the generators' schedule "
            "picks prompts by row index (and a resume depends on it). Load it without streaming=True, or turn it "
            "into a datasets.Dataset (Dataset.from_generator / Dataset.from_list)."
        )
    columns = getattr(dataset, "column_names", None)
    if columns is None or "prompt" not in columns:
        raise ValueError(
            f"The training dataset needs a `prompt` column (text or chat messages), as for TRL's GRPOTrainer; "
            f"it has columns {columns}. Rename your prompt column with `dataset.rename_column(old, 'prompt')`."
        )
    if len(dataset) == 0:
        raise ValueError("The training dataset is empty.")
    images = [c for c in ("image", "images") if c in columns]
    if images:  # TRL feeds them to a vision-language policy; here they would only reach the reward functions
        raise ValueError(f"The training dataset has an {images[0]!r} column: image prompts (vision-language policies) "
                         "are not supported; the generator samples from the text prompt only. Remove the column (or "
                         "rename it, if only your reward functions read it).")
    longest = 0
    for i, prompt in enumerate(dataset["prompt"]):
        try:
            ids = encoder.encode(prompt)
        except Exception as exc:
            raise ValueError(f"Row {i} of the training dataset: cannot encode its prompt: {exc}") from exc
        if not ids:
            raise ValueError(f"Row {i} of the training dataset has an empty prompt.")
        if len(ids) + max_completion_length > max_model_len:
            raise ValueError(
                f"Row {i} of the training dataset: its prompt is {len(ids)} tokens, and with max_completion_length="
                f"{max_completion_length} that exceeds the model's context of {max_model_len} tokens. Shorten or "
                "filter long prompts, or lower max_completion_length."
            )
        longest = max(longest, len(ids))
    return longest
