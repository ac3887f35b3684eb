"""The staleness study's built-in tasks: prompts, gold answers, a reward and a tiny model that starts at chance.

Each task is a tiny random-init Llama (`hfllamarl.testing.tiny`, character tokenizer) that a short supervised
warm-up taught the answer *format* only: `\\boxed{N}<eos>` with N drawn from the task's answers at random (never the
prompt's own), so RL starts where an instruct model would, knowing how to answer but not what. The reward is the
TRL contract: 1.0 when the content of the completion's last `\\boxed{}` is the gold answer, else 0.0.

- `successor`: "a+1=" -> (a+1) mod 10, 10 prompts, one digit (the demo task): a tiny model goes from 0.1 to ~0.9
  in 300 steps of 64 completions.
- `increment`: "a+1=" -> a+1 for a in 0..99: 100 prompts, answers of one to three digits (a carry into the tens,
  into the hundreds for 99), scored with partial credit (`digit_credit`: the share of digits right, aligned from
  the units). A wider tiny model (hidden 128) starts near 0.1 and improves over several hundred steps (0.2-0.4
  after 500 steps, depending on the seed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable


def boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (braces balanced), or None when there is none or it is not
    closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def exact_boxed(completions, answer, **kwargs) -> list[float]:
    """TRL reward: 1.0 when the last `\\boxed{}` of the completion holds exactly the gold `answer`, else 0.0."""
    out = []
    for completion, gold in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        out.append(1.0 if boxed_content(text) == str(gold).strip() else 0.0)
    return out


def digit_credit(completions, answer, **kwargs) -> list[float]:
    """TRL reward with partial credit: the share of the gold answer's digits that the last `\\boxed{}` holds in the
    same place (aligned from the units), over the longer of the two; 0.0 without a closed box or with anything but
    digits in it."""
    out = []
    for completion, gold in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        got, gold = boxed_content(text), str(gold).strip()
        if not got or not got.isdigit():
            out.append(0.0)
            continue
        same = sum(a == b for a, b in zip(reversed(got), reversed(gold)))
        out.append(same / max(len(got), len(gold)))
    return out


@dataclass(frozen=True)
class Task:
    """A study task: its dataset rows, reward, completion length, default budget and learning rate."""

    name: str
    rows: Callable[[], list[dict]]  # the training rows: {"prompt", "answer"}
    max_completion_length: int
    steps: int  # default optimizer steps of a run (64 completions each)
    learning_rate: float
    reward: Callable = exact_boxed
    hidden_size: int = 64  # the tiny Llama's width (heads of 32)

    def prepare_model(self, directory: str) -> str:
        """The task's warmed-up tiny model, built once into `directory` (see the module's text); returns its path."""
        return prepare_model(directory, self.rows(), self.hidden_size)


def successor_rows() -> list[dict]:
    rng = random.Random(1)
    return [{"prompt": f"{a}+1=", "answer": str((a + 1) % 10)} for a in (rng.randrange(10) for _ in range(4096))]


def increment_rows() -> list[dict]:
    rng = random.Random(1)
    return [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in (rng.randrange(100) for _ in range(4096))]


TASKS = {
    "successor": Task("successor", successor_rows, max_completion_length=4, steps=300, learning_rate=5e-4),
    "increment": Task("increment", increment_rows, max_completion_length=6, steps=500, learning_rate=5e-4,
                      reward=digit_credit, hidden_size=128),
}


def warm_up_format(path: str, rows: list[dict], steps: int = 80, batch_size: int = 64, lr: float = 3e-3,
                   seed: int = 0) -> dict:
    """Supervised warm-up of the model at `path` on `\\boxed{N}<eos>` after each prompt, N a gold answer of another
    row drawn at random (the format and the answers' lengths, not the mapping); saves it. Returns the first and last
    losses."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    answers = sorted({r["answer"] for r in rows})
    first = last = None
    for _ in range(steps):
        batch = [rng.choice(rows) for _ in range(batch_size)]
        pairs = [(tok(r["prompt"], add_special_tokens=False)["input_ids"],
                  tok(f"\\boxed{{{rng.choice(answers)}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                 for r in batch]
        width = max(len(p) + len(t) for p, t in pairs)
        ids = torch.full((batch_size, width), tok.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (p, t) in enumerate(pairs):
            ids[i, :len(p) + len(t)] = torch.tensor(p + t)
            labels[i, len(p):len(p) + len(t)] = torch.tensor(t)  # learn the completion only
            attention[i, :len(p) + len(t)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    model.save_pretrained(path)
    return {"loss_first": first, "loss_last": last}


def prepare_model(directory: str, rows: list[dict], hidden_size: int = 64) -> str:
    """Build the tiny model and warm up its format once into `directory` (`hfllamarl.testing.tiny.build_once`)."""
    from hfllamarl.testing.tiny import build_once, build_tiny_model

    def build(path: str) -> None:
        build_tiny_model(path, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_heads=hidden_size // 32, seed=0)
        warm_up_format(path, rows)

    return build_once(directory, build)
