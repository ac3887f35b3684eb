"""A side-by-side run as a new user would write it, on a task that is not the bench's: a byte-level BPE tokenizer
trained on GSM8K with a ChatML template, a random-init Qwen2 (256 wide, 4 layers), GSM8K questions as conversations,
a reward for the share of digits in the completion; TRL's GRPOConfig defaults otherwise (gradient checkpointing on,
scale_rewards as each side defaults). The same script under TRL's GRPOTrainer and AsyncAIPOTrainer; it prints the
rewards per step (and grad norms) as one JSON line.

    GSM8K=../shared/data/gsm8k_train.jsonl python scripts/side_by_side_new_user.py build MODEL_DIR
    python scripts/side_by_side_new_user.py run MODEL_DIR OUT --trainer trl|hfllamarl [--lr 1e-3] [--bf16] [--seed 0]
        [--steps 20] [--lora] [--extra '{"beta": 0.04}']
"""
import argparse
import json
import os
import sys

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


DATA = os.environ.get("GSM8K", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                             "gsm8k_train.jsonl"))


def rows(n=400):
    out = []
    with open(DATA) as fh:
        for line in fh:
            r = json.loads(line)
            out.append(r)
            if len(out) >= n:
                break
    return out


def build(d):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    import torch
    texts = [r["question"] + " " + r["answer"] for r in rows(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, tr)
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    t.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(t), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id, bos_token_id=None,
                      tie_word_embeddings=True)
    m = Qwen2ForCausalLM(cfg)
    m.save_pretrained(d)
    t.save_pretrained(d)
    m.generation_config.save_pretrained(d)
    print("built", d, len(t))


def digits(completions, **kw):
    out = []
    for c in completions:
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(sum(ch.isdigit() for ch in text) / max(len(text), 1))
    return out


def run(a):
    from datasets import Dataset
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}]} for r in rows()])
    common = dict(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=16, num_generations=4,
                  max_completion_length=64, learning_rate=a.lr, logging_steps=1, save_strategy="no",
                  report_to="none", bf16=a.bf16, use_cpu=True, seed=a.seed, log_completions=a.show)
    common.update(json.loads(a.extra))
    if a.trainer == "trl":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from hfllamarl import AsyncAIPOConfig as Config, AsyncAIPOTrainer as Trainer
    peft = None
    if a.lora:
        from peft import LoraConfig
        peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    tr = Trainer(model=a.model, reward_funcs=digits, args=Config(**common), train_dataset=data, peft_config=peft)
    tr.train()
    h = [x for x in tr.state.log_history if "reward" in x]
    print("RESULT " + json.dumps({"reward": [x["reward"] for x in h],
                                  "len": [x.get("completions/mean_length") for x in h],
                                  "term": [x.get("completions/mean_terminated_length") for x in h],
                                  "clipped": [x.get("completions/clipped_ratio") for x in h],
                                  "grad_norm": [x.get("grad_norm") for x in tr.state.log_history if "grad_norm" in x]}))


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        p = argparse.ArgumentParser()
        p.add_argument("cmd"); p.add_argument("model"); p.add_argument("out")
        p.add_argument("--trainer", default="hfllamarl"); p.add_argument("--lr", type=float, default=1e-6)
        p.add_argument("--seed", type=int, default=0); p.add_argument("--steps", type=int, default=20)
        p.add_argument("--bf16", action="store_true"); p.add_argument("--show", action="store_true")
        p.add_argument("--extra", default="{}")
        p.add_argument("--lora", action="store_true")
        run(p.parse_args())
