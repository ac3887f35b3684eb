"""A tiny chat model that can call tools: a tokenizer carrying a real chat template, and its warm-up.

`build_tiny_model(path, chat_template="qwen3")` (`hfllamarl.testing.tiny`) writes a random-init model with the
tokenizer of this module: TRL's copy of the Qwen3 chat template (so `trl.chat_template_utils.add_response_schema`
recognises it and `parse_response` reads tool calls the way it reads a real Qwen3's), its special tokens
(`<|im_start|>`, `<|im_end|>` as end of turn, `<tool_call>`, `<tool_response>`, `<think>`, ...) as single tokens,
numbers from 10 to 199 one token each, every other character one token, and the template's fixed sentences and
JSON keys one token each, so that a prompt with a tool schema is ~100 tokens instead of ~800 characters.

The calculator task (`calculator_rows`, `warm_start_tool_calls`) is the CPU example's: "What is 37+45?"; the
model may call `calculator(expression)` and must answer `\\boxed{82}`. The warm-up teaches the format of both
ways of answering (a tool call copying the expression, then the tool's result boxed; or a boxed guess without
the tool); `prepare_tool_model` ends it with the tool called in a quarter of the examples, so reinforcement
learning has something to learn: that calling the tool pays.
"""

from __future__ import annotations

import os
import random

from hfllamarl.testing.tiny import build_tiny_model

#: The calculator task's tool, as the example and the tests give it (`tools=[calculator]`).
TOOL_NAME = "calculator"
#: Text an environment's reset() may append to the question (`warm_start_tool_calls(hint_share=...)`).
HINT = " Use the calculator."


# ---------------------------------------------------------------------------- the calculator task
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12+30".
    """
    from hfllamarl.plugins.environments.calculator import evaluate

    return evaluate(expression)


def calculator_rows(num_rows: int, seed: int = 0, low: int = 10, high: int = 99) -> list[dict]:
    """Rows of the calculator task: a chat prompt "What is a+b?" and the sum as `answer`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": str(a + b)})
    return rows


def _conversation(call: bool) -> list[dict]:
    """One warm-up conversation with placeholders for its numbers: the call and the boxed tool result, or a boxed
    guess without the tool."""
    question = [{"role": "user", "content": "What is @A+@B?@H"}]
    if not call:
        return question + [{"role": "assistant", "content": "\\boxed{@G}"}]
    return question + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": "@A+@B"}}}]},
        {"role": "tool", "name": TOOL_NAME, "content": "@S"},
        {"role": "assistant", "content": "\\boxed{@S}"},
    ]


def warm_start_tool_calls(path: str, steps: int = 300, batch_size: int = 32, lr: float = 3e-3, call_share: float = 0.25,
                          seed: int = 0, chat_template_kwargs: dict | None = None, hint_share: float = 0.0) -> dict:
    """Teach the model at `path` the two answer formats of the calculator task, and save it.

    The conversations are rendered with the calculator's schema and the template the trainer renders with
    (TRL's training variant of the tokenizer's, when that one is not prefix-preserving); the loss covers the
    assistant's tokens only (tool results and prompts are given). `hint_share` of the questions end with `HINT` (an
    environment's reset() text; the copy of the numbers is then harder to learn: their distance to the call varies).
    Returns {"loss_first", "loss_last"}.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfllamarl.runtime.agents.tool_chat import ToolChat

    kwargs = {"enable_thinking": False} if chat_template_kwargs is None else chat_template_kwargs
    tok = AutoTokenizer.from_pretrained(path)
    kwargs = dict(kwargs, chat_template=ToolChat(tok, kwargs).chat_template)  # the template the trainer renders with
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # The template is rendered once per form, with placeholders for the numbers (the tokenizer then reads the
    # text as apply_chat_template(tokenize=True) does); rendering every example would take most of the time.
    texts = {call: tok.apply_chat_template(_conversation(call), tools=[calculator], tokenize=False, **kwargs)
             for call in (False, True)}
    opening = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True,
                                      **kwargs)
    opening = tok(opening[opening.rindex("<|im_start|>"):], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    first = last = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small run faster on one thread than on two that compete
    try:
        for _ in range(steps):
            first, last = _warm_step(model, opt, tok, texts, opening, rng, batch_size, call_share, hint_share, first)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(path)
    return {"loss_first": first, "loss_last": last}


def _warm_step(model, opt, tok, texts: dict, opening: list[int], rng: random.Random, batch_size: int,
               call_share: float, hint_share: float, first):
    """One supervised step on `batch_size` fresh conversations; returns (first loss seen, this step's loss)."""
    import torch

    rows = []
    for _ in range(batch_size):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        text = texts[rng.random() < call_share]
        hint = HINT if rng.random() < hint_share else ""  # an environment's reset() text
        for key, value in (("@A", a), ("@B", b), ("@S", a + b), ("@G", rng.randint(20, 198)), ("@H", hint)):
            text = text.replace(key, str(value))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        rows.append((ids, _assistant_labels(ids, opening, tok.eos_token_id)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
        mask[i, :len(row_ids)] = 1
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return (loss.item() if first is None else first), loss.item()


def _assistant_labels(ids: list[int], opening: list[int], eos: int) -> list[int]:
    """Labels that train the assistant turns only: each turn's tokens after its opening (`<|im_start|>assistant`
    and the template's thinking block), through its end-of-turn token; -100 elsewhere."""
    labels = [-100] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i:i + len(opening)] == opening:
            j = i + len(opening)
            while j < len(ids) and ids[j] != eos:
                labels[j] = ids[j]
                j += 1
            if j < len(ids):
                labels[j] = eos
            i = j
        i += 1
    return labels


def prepare_tool_model(directory: str, hidden_size: int = 64, num_heads: int = 2, copy_steps: int = 800,
                       decide_steps: int = 60, call_share: float = 0.25, seed: int = 0) -> str:
    """Build the calculator example's model once into `directory`: the tiny model with the Qwen3 chat template
    (hidden 64, 2 heads of 32, 2 layers), warmed up in two phases. First every warm-up answer calls the tool
    (`copy_steps`): the model learns the call format and to copy the numbers into the call and the tool's result
    into the box (a skill that appears suddenly, after ~400 steps here, and sharpens after). Then only `call_share`
    of them do (`decide_steps`): the model keeps the skill (about 70 % of its sampled calls end in the right boxed
    sum) but calls the tool in about 15 % of its answers, leaving RL the decision to learn.

    Several processes (a launcher's ranks) may call it at once: each builds in a temporary directory (same seed,
    same bits) and renames it into place; the first rename wins.
    """
    import shutil
    import tempfile

    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".building-")
    build_tiny_model(tmp, hidden_size=hidden_size, num_heads=num_heads, intermediate_size=2 * hidden_size,
                     max_position_embeddings=512, seed=seed, chat_template="qwen3")
    warm_start_tool_calls(tmp, steps=copy_steps, call_share=1.0, seed=seed)
    warm_start_tool_calls(tmp, steps=decide_steps, call_share=call_share, seed=seed + 1)
    try:
        os.rename(tmp, directory)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
