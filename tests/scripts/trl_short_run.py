"""Short runs under TRL's GRPOTrainer and AsyncAIPOTrainer, same configs: 3 steps, fewer than logging_steps, a tokenizer
with its own chat template given as processing_class while the model is a path; "plain" without evaluation, "eval"
with an evaluation every 2 steps. Each AsyncAIPOTrainer run is also resumed from its step-2 checkpoint. Prints one
JSON line: `RESULT {"trl_plain": log_history, "ours_plain": ..., "resumed_plain": ..., "trl_eval": ..., ...}`.

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


def run(side: str, model: str, out: str, evaluate: bool, resume=None) -> list[dict]:
    if side == "trl":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from hfllamarl import AsyncAIPOConfig as Config, AsyncAIPOTrainer as Trainer
    args = Config(output_dir=out, max_steps=3, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=4, learning_rate=1e-3, logging_steps=10,
                  eval_strategy="steps" if evaluate else "no", eval_steps=2, per_device_eval_batch_size=8, save_strategy="steps", save_steps=2,
                  report_to="none", bf16=False, use_cpu=True, seed=0)
    trainer = Trainer(model=model, reward_funcs=short, args=args, processing_class=tokenizer(model),
                      train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 40),
                      eval_dataset=Dataset.from_list([{"prompt": PROMPT}] * 2) if evaluate else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer.state.log_history


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    a = p.parse_args()
    result = {}
    for kind in ("plain", "eval"):
        result[f"trl_{kind}"] = run("trl", a.model, os.path.join(a.out, f"trl_{kind}"), kind == "eval")
        ours = os.path.join(a.out, f"ours_{kind}")
        result[f"ours_{kind}"] = run("hfllamarl", a.model, ours, kind == "eval")
        result[f"resumed_{kind}"] = run("hfllamarl", a.model, ours, kind == "eval",
                                        resume=os.path.join(ours, "checkpoint-2"))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
