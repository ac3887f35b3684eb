"""How a model's chat template writes tool calls and tool results, with TRL's own helpers.

A multi-turn rollout is one token sequence: the prompt (rendered with the tools' schemas), the model's
first turn, the tokens that present the tool results and open the next assistant turn (the "suffix", never
trained), the model's next turn, and so on. As in TRL's `GRPOTrainer`:

- the tokenizer gets TRL's response template for its chat template (`add_response_schema`: Qwen2.5/Qwen3,
  Llama 3.1/3.2, GLM-4-MoE, GPT-OSS, Gemma 4, ...), and each finished turn is read with TRL's
  `parse_response` (a malformed tool call is read as plain text);
- a template that is not prefix-preserving (Qwen3 renders the thinking block of earlier turns differently)
  is replaced by TRL's training variant of it (`get_training_chat_template`) for prompts and suffixes;
- the suffix is what the template adds when tool messages follow a turn that called them: the difference
  between a short conversation rendered without and with those messages, cut after the end-of-turn token
  (so the model's own end-of-turn token stays the last one it sampled).

Nothing is re-tokenized: a turn's sampled tokens stay as sampled, the suffix is appended as token ids.
"""

from __future__ import annotations

from typing import Any


class ToolChatError(ValueError):
    """The tokenizer's chat template cannot carry tool calls the way the trainer needs."""


class ToolChat:
    """The chat-template side of tool calling for one tokenizer (prepared once, on every rank that needs it).

    Args:
        tokenizer: the policy's tokenizer; its response template is set here when it has none.
        chat_template_kwargs: the config's `chat_template_kwargs`, passed to every rendering.
    """

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        from trl.chat_template_utils import (add_response_schema, get_training_chat_template,
                                             is_chat_template_prefix_preserving, supports_tool_calling)

        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        if not supports_tool_calling(tokenizer):
            raise ToolChatError(
                "The tokenizer's chat template cannot render a tool-calling conversation (user -> assistant with "
                "tool_calls -> tool): tools and environments need a chat template made for tool use (e.g. Qwen3's, "
                "Llama 3.1's), set on processing_class.chat_template.")
        if all(getattr(tokenizer, name, None) is None for name in ("response_template", "response_schema")):
            try:
                add_response_schema(tokenizer)
            except ValueError as exc:
                raise ToolChatError(
                    f"{exc} Tool calls are read from the model's output with the tokenizer's response template: set "
                    "processing_class.response_template for this chat template, or use one TRL recognises.") from None
        self.chat_template = None if is_chat_template_prefix_preserving(tokenizer) else \
            get_training_chat_template(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id

    def encode_prompt(self, messages: list[dict], tools: list | None) -> list[int]:
        """Token ids of a chat prompt with the tools' schemas and the generation prompt (TRL's call)."""
        out = self.tokenizer.apply_chat_template(
            messages, tools=tools or None,  # `or None`: some templates (Llama) write tool boilerplate for []
            chat_template=self.chat_template, add_generation_prompt=True, tokenize=True, return_dict=True,
            **self.kwargs)
        ids = out["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def parse(self, ids: list[int], prefix: list[int], tools: list | None) -> dict:
        """One finished assistant turn (its sampled ids; `prefix`: every token before it) as a message dict,
        with `tool_calls` when the model called tools."""
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, ids, prefix=prefix, tools=tools)

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens that follow a turn's end-of-turn token when `tool_messages` answer it: the tool results as
        the template writes them, then the next assistant turn's opening (generation prompt)."""
        call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        before = self._render(head, generation_prompt=False)
        after = self._render(head + tool_messages, generation_prompt=True)
        ends = [i for i, t in enumerate(before) if t == self.eos_token_id]
        if ends:  # the turn ends at its end-of-turn token; what the template writes after it is suffix
            before = before[:ends[-1] + 1]
        if after[:len(before)] != before:
            raise ToolChatError("the chat template renders a turn differently once tool messages follow it, so the "
                                "tool results cannot be appended as tokens; use a prefix-preserving template.")
        return after[len(before):]

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        ids: Any = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=True,
                                                      add_generation_prompt=generation_prompt, return_dict=False,
                                                      **self.kwargs)
        return list(ids)
