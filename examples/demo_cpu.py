"""CPU demo: asynchronous AIPO teaches a tiny Llama to answer "a+1=" with \\boxed{(a+1) mod 10}.

The model is built locally (random init, character tokenizer: no model hub), warmed up for a few
seconds on the answer *format* only (random digits, so it starts at chance, ~0.1 reward), then
trained by RL with the `math_sympy` reward: one vLLM generator process and one trainer process,
generation of step k+1 overlapping training on step k (staleness 1, corrected by AIPO).

Run it any of these ways (no GPU needed):

    python examples/demo_cpu.py
    torchrun --nproc_per_node 2 examples/demo_cpu.py
    accelerate launch --config_file examples/accelerate/multi_process.yaml examples/demo_cpu.py
    accelerate launch --multi_gpu --num_processes 2 examples/demo_cpu.py

It prints the reward of the first and last 10 steps, and where the TensorBoard log and the
reward-curve PNG are.
"""

from __future__ import annotations

import argparse
import json
import os

from datasets import Dataset

from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
from hfllamarl.testing.tiny import prepare_demo_model, successor_rows


def plot_rewards(log_history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log_history if "reward" in r]
    rewards = [r["reward"] for r in log_history if "reward" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title("AIPO (staleness 1) on the successor task")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="outputs/demo_cpu")
    parser.add_argument("--model", default=None, help="model directory (built here if missing)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--reward", default="math_sympy")
    parser.add_argument("--report-to", default="tensorboard")
    parser.add_argument("--weight-sync", default="nccl_ddma")
    args = parser.parse_args()

    model_dir = prepare_demo_model(args.model or os.path.join(args.output_dir, "tiny-llama"))
    dataset = Dataset.from_list(successor_rows(4096, seed=1))
    config = AsyncAIPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=64,  # 8 prompts x 8 completions per step
        num_generations=8,
        max_completion_length=4,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=args.report_to,
        max_staleness=args.max_staleness,
        weight_sync_backend=args.weight_sync,
        seed=0,
        collective_timeout_s=300,
    )
    trainer = AsyncAIPOTrainer(model=model_dir, reward_funcs=args.reward, args=config, train_dataset=dataset)
    trainer.train()
    if trainer.state is None or not trainer.state.is_world_process_zero:
        return  # generator ranks and non-zero trainer ranks are done
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    first, last = sum(rewards[:10]) / len(rewards[:10]), sum(rewards[-10:]) / len(rewards[-10:])
    png = os.path.join(args.output_dir, "reward_curve.png")
    plot_rewards(trainer.state.log_history, png)
    callbacks = trainer.callback_handler.callbacks if trainer.callback_handler is not None else []
    tb = next((cb for cb in callbacks if type(cb).__name__ == "TensorBoardCallback"), None)
    summary = {
        "reward_first_10": round(first, 4),
        "reward_last_10": round(last, 4),
        "steps": len(rewards),
        "train_runtime_s": trainer.state.log_history[-1].get("train_runtime"),
        "tokens_per_s": round(_mean(trainer.state.log_history, "generation/tokens_per_s"), 1),
        "weight_sync_s": round(_mean(trainer.state.log_history, "weight_sync_seconds"), 4),
        "reward_curve_png": png,
        "tensorboard_logdir": getattr(tb, "logging_dir", None) if tb else None,
    }
    print(f"reward: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
    print(f"reward curve: {png}")
    if summary["tensorboard_logdir"]:
        print(f"TensorBoard:  tensorboard --logdir {summary['tensorboard_logdir']}")
    print(json.dumps(summary))


def _mean(history: list[dict], key: str) -> float:
    vals = [r[key] for r in history if key in r]
    return sum(vals) / len(vals) if vals else 0.0


if __name__ == "__main__":
    main()
