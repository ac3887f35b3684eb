"""Tiny local models for the demo, the tests and the benchmarks (no model hub needed).

`build_tiny_model(path)` writes a random-init Llama (or, with `family=`, a Qwen2/Qwen3/Qwen3-MoE or
grouped-query Llama shape) and a character-level tokenizer to `path` in the Hugging Face format, so everything downstream loads it with `from_pretrained(path)`,
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


# Families of real architectures, in shapes vLLM's CPU backend runs (head size 32): each differs from
# the demo Llama where real checkpoints do.
FAMILIES = {
    # the demo model: as many KV heads as attention heads, untied, no biases
    "llama": dict(num_attention_heads=2, num_key_value_heads=2),
    # Llama-3 style grouped-query attention down to one KV head (fewer KV heads than a TP-2 generator has ranks)
    "llama_gqa": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256),
    # Qwen2.5 style: q/k/v biases, tied embeddings, 2 KV heads
    "qwen2": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                  tie_word_embeddings=True),
    # Qwen3 style: q/k RMS norms, an explicit head_dim, 1 KV head
    "qwen3": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256),
    # Mistral style: a sliding attention window (4) shorter than the tests' prompt + completion, 2 KV heads
    "mistral": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                    sliding_window=4),
    # Llama-3.2 style: tied embeddings, llama3 RoPE scaling, 1 KV head
    "llama32": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256,
                    tie_word_embeddings=True,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}),
    # Qwen3-MoE style: 4 experts, 2 per token, q/k norms; transformers keeps the experts fused ([E, 2I, H])
    "qwen3_moe": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=256, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, norm_topk_prob=True),
}
_CLASSES = {"llama": "Llama", "llama_gqa": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
            "mistral": "Mistral", "llama32": "Llama"}


def build_tiny_model(
    path: str,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
    seed: int = 0,
    family: str = "llama",
    chat_template: str | None = None,
):
    """Write a random-init causal LM of `family` (see `FAMILIES`) and its tokenizer to `path`; return `path`.

    `chat_template="qwen3"` (or another name of TRL's `chat_templates/`) gives it the chat tokenizer of
    `hfllamarl.testing.chat_tokenizer` instead of the character one: that template, its special tokens, end of turn
    as end of sequence, so that it can call tools the way TRL parses them.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {sorted(FAMILIES)}")
    if chat_template is not None:
        from hfllamarl.testing.chat_tokenizer import build_chat_tokenizer

        tokenizer = build_chat_tokenizer(chat_template)
    else:
        tokenizer = build_tokenizer()
    shape = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, tie_word_embeddings=False)
    shape.update(FAMILIES[family])
    if num_heads is not None:
        shape.update(num_attention_heads=num_heads, num_key_value_heads=num_heads)
    prefix = _CLASSES[family]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=len(tokenizer),
        num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    if family in ("qwen2", "qwen3", "qwen3_moe"):  # give biases and norms values a zero/one init would hide
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("bias", "norm.weight")):
                    p.add_(torch.randn_like(p) * 0.1)
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


def build_once(directory: str, build) -> str:
    """A model directory built once: `build(path)` writes it into a temporary directory beside `directory`, renamed
    into place. Several processes (a launcher's ranks) may race: each builds (same seed, same bits) and the first
    rename wins. Returns `directory`."""
    import shutil
    import tempfile

    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".building-")
    build(tmp)
    try:
        os.rename(tmp, directory)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def prepare_demo_model(directory: str) -> str:
    """Build the tiny model and warm up its answer format once, into `directory` (`build_once`)."""

    def build(path: str) -> None:
        build_tiny_model(path, seed=0)
        warm_start_format(path, seed=0)

    return build_once(directory, build)


def prepare_demo(directory: str, num_rows: int = 4096, seed: int = 1) -> dict:
    """The demo task's files, built once into `directory`: the warmed-up tiny model and a JSONL of successor rows.

    A recipe's `prepare` builder (`examples/recipes/demo_cpu.yaml`): it returns the recipe fields naming what it
    built, which the trainer then loads like any model directory and data file.
    """
    import json

    model = prepare_demo_model(os.path.join(directory, "tiny-llama"))
    data = os.path.join(directory, "successor.jsonl")
    if not os.path.isfile(data):
        tmp = f"{data}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            for row in successor_rows(num_rows, seed=seed):
                fh.write(json.dumps(row) + "\n")
        os.replace(tmp, data)
    return {"model_name_or_path": model, "dataset_name": data}
