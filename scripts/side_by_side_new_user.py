"""A side-by-side run as a new user would write it, on a task that is not the bench's: a byte-level BPE tokenizer
trained on GSM8K with a ChatML template, a random-init Qwen2 (256 wide, 4 layers, tied embeddings), GSM8K questions
as conversations, a reward for the share of digits in the completion; TRL's GRPOConfig defaults otherwise (gradient
checkpointing on, each side's own scale_rewards). The same script runs TRL's GRPOTrainer or AsyncAIPOTrainer and
prints the rewards and grad norms per step as one JSON line (`RESULT {...}`).

    python scripts/side_by_side_new_user.py build MODEL_DIR
    python scripts/side_by_side_new_user.py run MODEL_DIR OUT --trainer trl|hfllamarl --lr 1e-3 --bf16 --seed 0
        [--steps 20] [--lora] [--extra '{"beta": 0.04}']

GSM8K comes from $GSM8K, or ../shared/data/gsm8k_train.jsonl beside the checkout. The learning rate defaults to
TRL's (1e-6), at which nothing learns in 20 steps (both sides then score the same initial policy); the measurements
page used 1e-3.
"""

import argparse
import itertools
import json
import os

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DATA = os.environ.get("GSM8K", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                                            "data", "gsm8k_train.jsonl"))


def rows(n: int) -> list[dict]:
    """The first `n` GSM8K records."""
    if not os.path.isfile(DATA):
        raise SystemExit(f"no GSM8K file at {DATA}: set GSM8K to a gsm8k_train.jsonl (one JSON record a line)")
    with open(DATA) as fh:
        return [json.loads(line) for line in itertools.islice(fh, n)]


def build(directory: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([r["question"] + " " + r["answer"] for r in rows(2000)],
                            trainers.BpeTrainer(vocab_size=1000,
                                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None))
    model.save_pretrained(directory)  # (with its generation config)
    tokenizer.save_pretrained(directory)
    print("built", directory, len(tokenizer))


def digits(completions, **kwargs) -> list[float]:
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


def run(a) -> None:
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}]} for r in rows(400)])
    settings = dict(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=16, num_generations=4,
                    max_completion_length=64, learning_rate=a.lr, logging_steps=1, save_strategy="no",
                    report_to="none", bf16=a.bf16, use_cpu=True, seed=a.seed, **json.loads(a.extra))
    if a.trainer == "trl":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from hfllamarl import AsyncAIPOConfig as Config, AsyncAIPOTrainer as Trainer
    peft = None
    if a.lora:
        from peft import LoraConfig

        peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = Trainer(model=a.model, reward_funcs=digits, args=Config(**settings), train_dataset=data,
                      peft_config=peft)
    trainer.train()
    history = trainer.state.log_history
    print("RESULT " + json.dumps({"reward": [x["reward"] for x in history if "reward" in x],
                                  "grad_norm": [x["grad_norm"] for x in history if "grad_norm" in x]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="write the tokenizer and the random-init model").add_argument("model")
    r = sub.add_parser("run", help="train one side")
    r.add_argument("model")
    r.add_argument("out")
    r.add_argument("--trainer", choices=("trl", "hfllamarl"), default="hfllamarl")
    r.add_argument("--lr", type=float, default=1e-6)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--bf16", action="store_true")
    r.add_argument("--lora", action="store_true", help="LoRA r 8 on every linear layer")
    r.add_argument("--extra", default="{}", help="more config fields, as JSON")
    a = parser.parse_args()
    if a.command == "build":
        build(a.model)
    else:
        run(a)


if __name__ == "__main__":
    main()
