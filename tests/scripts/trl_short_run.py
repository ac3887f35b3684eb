"""One short run under TRL's GRPOTrainer and AsyncAIPOTrainer (same config: fewer steps than logging_steps, an
evaluation every 2 of 3 steps, a tokenizer with its own chat template given as processing_class while the model is a
path), then the AsyncAIPOTrainer run resumed from its step-2 checkpoint. Prints one JSON line:
`RESULT {"trl": log_history, "ours": log_history, "resumed": log_history}`.

    python tests/scripts/trl_short_run.py MODEL_DIR OUTPUT_DIR
"""

import argparse
import json
import os

from datasets import Dataset

# A template of the user's own (open-r1 sets `tokenizer.chat_template = ...`): each message behind a long marker
CUSTOM_TEMPLATE = ("{% for m in messages %}SYSTEM-X: SYSTEM-X: SYSTEM-X: SYSTEM-X: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}ANSWER:{% endif %}")
PROMPT = [{"role": "user", "content": "What is 2+2?"}]


def short(completions, **kwargs):
    return [1.0 / (1 + len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


def tokenizer(model: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = CUSTOM_TEMPLATE
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def run(side: str, model: str, out: str, resume=None) -> list[dict]:
    if side == "trl":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from hfllamarl import AsyncAIPOConfig as Config, AsyncAIPOTrainer as Trainer
    args = Config(output_dir=out, max_steps=3, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=4, learning_rate=1e-3, logging_steps=10, eval_strategy="steps",
                  eval_steps=2, per_device_eval_batch_size=8, save_strategy="steps", save_steps=2,
                  report_to="none", bf16=False, use_cpu=True, seed=0)
    trainer = Trainer(model=model, reward_funcs=short, args=args, processing_class=tokenizer(model),
                      train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 40),
                      eval_dataset=Dataset.from_list([{"prompt": PROMPT}] * 2))
    trainer.train(resume_from_checkpoint=resume)
    return trainer.state.log_history


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    a = p.parse_args()
    result = {"trl": run("trl", a.model, os.path.join(a.out, "trl"))}
    ours = os.path.join(a.out, "ours")
    result["ours"] = run("hfllamarl", a.model, ours)
    result["resumed"] = run("hfllamarl", a.model, ours, resume=os.path.join(ours, "checkpoint-2"))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
