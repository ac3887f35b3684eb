"""The chat tokenizer of the tiny tool-calling models: TRL's copy of a real chat template (Qwen3's by default, so
`trl.chat_template_utils.add_response_schema` recognises it), its special tokens and markers as single tokens,
numbers from 10 to 199 one token each, every other character one token, and the template's fixed sentences and
JSON keys one token each (a prompt with a tool schema is ~100 tokens instead of ~800 characters).

`build_tiny_model(path, chat_template="qwen3")` (`hfllamarl.testing.tiny`) uses it; the calculator task and its
warm-up are in `hfllamarl.testing.tiny_chat`."""

from __future__ import annotations

import os

#: Special tokens (skipped when decoding with skip_special_tokens) and the template's other markers.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>", "\\boxed{"]
# Multi-character pieces: the template's fixed sentences (between its markers), JSON keys and values tools
# schemas repeat, and a few words of the example tasks. Longest first in the pre-tokenizer.
PIECES = [
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>",
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within ",
    " XML tags:\n",
    '\n{"name": <function-name>, "arguments": <args-json-object>}\n',
    '"type"', '"function"', '"name"', '"description"', '"parameters"', '"object"', '"properties"', '"string"',
    '"integer"', '"number"', '"boolean"', '"array"', '"items"', '"required"', '"return"', '"arguments"', '"error"',
    "system", "user", "assistant", "What is ", "calculator", "expression", "Evaluate", "arithmetic", " Use the ",
    # numbers from 10 to 199 are one token each: the calculator task's operands and sums are copied as single
    # tokens (a tiny model learns to copy one token from a fixed distance much faster than a run of digits)
    *(str(n) for n in range(10, 200)),
]
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
UNKNOWN = "\ufffd"



def chat_template_text(name: str = "qwen3") -> str:
    """TRL's stored copy of a model family's chat template (what `add_response_schema` recognises)."""
    import trl

    path = os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja")
    if not os.path.isfile(path):
        raise ValueError(f"TRL {trl.__version__} has no chat template {name!r} ({path}).")
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def build_chat_tokenizer(template: str = "qwen3"):
    """A `PreTrainedTokenizerFast`: special tokens and markers, the pieces above, then one token per character."""
    import re

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = sorted(set(PIECES), key=len, reverse=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + MARKERS + pieces + CHARS + [UNKNOWN])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNKNOWN))
    pattern = "|".join(re.escape(p) for p in pieces) + r"|[\s\S]"
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token=UNKNOWN)
    out.chat_template = chat_template_text(template)
    return out
