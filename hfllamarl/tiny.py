"""Tiny local models for the demo, the tests and the benchmarks (no model hub needed).

`build_tiny_model(path)` writes a random-init Llama and a character-level tokenizer to `path`
in the Hugging Face format, so everything downstream loads it with `from_pretrained(path)`,
exactly as it would load a real checkpoint.
"""

from __future__ import annotations

import os

# Characters the demo task and the math rewards need; `\boxed{` is one token so that a tiny
# model can learn the answer format quickly.
CHARS = list("0123456789+-*/=?.,() xabcdefghijklmnopqrstuvwyz}{")
SPECIAL = ["<pad>", "<bos>", "<eos>", "\\boxed{"]


def build_tokenizer():
    """Return a `PreTrainedTokenizerFast` over single characters plus `\\boxed{`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    # Split "\boxed{" off as one piece, then every other character on its own.
    # "\boxed{" is one piece, every other character is a piece of its own.
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"\\boxed\{|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="?",
    )


def build_tiny_model(
    path: str,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
    seed: int = 0,
):
    """Write a random-init `LlamaForCausalLM` and its tokenizer to `path`; return `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------- the demo task
def successor_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """Rows of the demo task: prompt "a+1=", gold answer (a+1) mod 10, to be given as \\boxed{d}."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a = rng.randrange(10)
        rows.append({"prompt": f"{a}+1=", "answer": str((a + 1) % 10)})
    return rows


def warm_start_format(path: str, steps: int = 60, batch_size: int = 64, lr: float = 3e-3, seed: int = 0) -> dict:
    """Teach the model at `path` the answer *format* `\\boxed{d}<eos>` with random digits d, and save it.

    RL starts from a model that knows how to answer (an instruct model, in real use); this short
    supervised warm-up gives the tiny random model that, without teaching it the right answers:
    the digits are drawn at random, so its success rate stays at chance (about 1 in 10).
    Returns {"loss_first", "loss_last"}.
    """
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    first = last = None
    for _ in range(steps):
        prompts, targets = [], []
        for _ in range(batch_size):
            a, d = rng.randrange(10), rng.randrange(10)
            prompts.append(tok(f"{a}+1=", add_special_tokens=False)["input_ids"])
            targets.append(tok(f"\\boxed{{{d}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        ids = torch.tensor([p + t for p, t in zip(prompts, targets)])
        labels = ids.clone()
        labels[:, : len(prompts[0])] = -100  # learn the completion only
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    model.save_pretrained(path)
    return {"loss_first": first, "loss_last": last}


def prepare_demo_model(directory: str) -> str:
    """Build the tiny model and warm up its answer format once, into `directory`.

    Several processes (a launcher's ranks) may call it at once: each builds in a temporary directory
    (same seed, same bits) and renames it into place; the first rename wins.
    """
    import shutil
    import tempfile

    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".building-")
    build_tiny_model(tmp, seed=0)
    warm_start_format(tmp, seed=0)
    try:
        os.rename(tmp, directory)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
