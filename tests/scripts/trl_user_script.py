"""A TRL user script run unchanged by both trainers: `--trainer trl` runs TRL's GRPOTrainer, `--trainer hfllamarl`
AsyncAIPOTrainer (only the class names differ). Its reward function uses TRL's `log_metric` and `log_extra`; a
callback ends the 4-step run after step 2 (control.should_training_stop).

    python tests/scripts/trl_user_script.py MODEL_DIR OUTPUT_DIR --trainer trl|hfllamarl
"""

import argparse
import json

from datasets import Dataset
from transformers import TrainerCallback


def digits(completions, log_metric=None, log_extra=None, **kwargs):
    scores = [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
    log_metric("digits/any", sum(s > 0 for s in scores) / len(scores))
    log_extra("digit_count", [sum(c.isdigit() for c in text) for text in completions])
    return scores


class StopAfterTwo(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= 2:
            control.should_training_stop = True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--trainer", default="hfllamarl")
    p.add_argument("--push", action="store_true", help="also push_to_hub (HF_HUB_OFFLINE=1 makes the upload fail)")
    a = p.parse_args()
    rows = [{"prompt": f"{i % 10}{(i + 3) % 10}?"} for i in range(40)]
    common = dict(output_dir=a.out, max_steps=4, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=6, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                  bf16=False, use_cpu=True, log_completions=True, num_completions_to_print=1, seed=0)
    if a.trainer == "trl":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from hfllamarl import AsyncAIPOConfig as Config, AsyncAIPOTrainer as Trainer
    trainer = Trainer(model=a.model, reward_funcs=digits, args=Config(**common), train_dataset=Dataset.from_list(rows),
                      callbacks=[StopAfterTwo()])
    result = trainer.train()
    trainer.accelerator.print("TRAINING DONE")
    # what open-r1's grpo.py does after train()
    metrics = result.metrics
    metrics["train_samples"] = len(rows)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.model.generation_config.eos_token_id = trainer.processing_class.eos_token_id
    trainer.save_model(a.out)
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(dataset_name="digits", tags=["test"])
        trainer.model.config.use_cache = True
        trainer.model.config.save_pretrained(a.out)
    if a.push:
        try:
            trainer.push_to_hub()
        except Exception as exc:  # no Hub here
            print(f"PUSH_FAILED {type(exc).__name__} repo={trainer.hub_model_id}")
    print("LOG_HISTORY " + json.dumps(trainer.state.log_history))
    trainer.end()


if __name__ == "__main__":
    main()
