"""One short run with num_iterations=2 (and sync_ref_model) under TRL's GRPOTrainer or AsyncAIPOTrainer (only the
class names differ), printing the log history.

    python tests/scripts/iterations_run.py MODEL_DIR OUTPUT_DIR --trainer trl|hfllamarl [--save-steps N]
        [--resume CHECKPOINT_DIR]
"""

import argparse
import json

from datasets import Dataset


def digits(completions, **kwargs):  # any deterministic function of the text that varies within a group
    return [sum(map(ord, text)) % 7 / 7 for text in completions]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--trainer", default="hfllamarl")
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    a = p.parse_args()
    rows = [{"prompt": f"{i % 10}{(i + 3) % 10}?"} for i in range(40)]
    common = dict(output_dir=a.out, max_steps=3, num_iterations=2, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=4, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
                  logging_steps=1, beta=0.1, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5,
                  save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500, report_to="none",
                  bf16=False, use_cpu=True, seed=0)
    if a.trainer == "trl":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from hfllamarl import AsyncAIPOConfig as Config, AsyncAIPOTrainer as Trainer
    trainer = Trainer(model=a.model, reward_funcs=digits, args=Config(**common), train_dataset=Dataset.from_list(rows))
    trainer.train(resume_from_checkpoint=a.resume)
    trainer.save_model(a.out)
    print("GLOBAL_STEP", trainer.state.global_step)
    print("LOG_HISTORY " + json.dumps(trainer.state.log_history))
    if hasattr(trainer, "end"):
        trainer.end()


if __name__ == "__main__":
    main()
