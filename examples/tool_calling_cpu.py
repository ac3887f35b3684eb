"""CPU example: a tiny model learns, by asynchronous RL, to call a calculator tool and box its result.

The task: "What is 37+45?"; the reward (`math_sympy`) is 1 when the last assistant message boxes the sum. The
model is built locally (random init, the Qwen3 chat template with its tool-call tokens: no model hub) and warmed up
on the two formats of an answer: calling `calculator(expression)` then boxing what it returns, or boxing a guess
without the tool (`hfllamarl.testing.tiny_chat.prepare_tool_model`: first every example calls the tool, so the model
learns to copy the numbers, then only a quarter do). It starts calling the tool in about 15 % of its answers and
never learned which way pays. A tiny model cannot add two-digit numbers itself, so RL (AIPO, staleness 1:
generation of step k+1 overlaps training on step k) has to learn that calling the tool pays.

Each rollout is multi-turn on the generator: the model's turn is parsed with TRL's Qwen3 response template, the
calculator runs (never `eval`: `hfllamarl.plugins.environments.calculator` computes arithmetic from a syntax
tree), its result is appended as tokens the trainer does not train on, and the model answers. The same script
trains under TRL's GRPOTrainer by swapping the two class names.

    python examples/tool_calling_cpu.py [--steps 60]
    torchrun --nproc_per_node 2 examples/tool_calling_cpu.py

It prints the mean reward of the first and last 10 steps, the share of answers that called the tool, and
writes a reward-curve PNG.
"""

from __future__ import annotations

import argparse
import json
import os

from datasets import Dataset

from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
from hfllamarl.testing.tiny_chat import calculator, calculator_rows, prepare_tool_model


def plot(log_history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in log_history if "reward" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], marker=".", label="reward")
    ax.plot([r["step"] for r in rows], [r["tools/call_frequency"] for r in rows], marker=".", alpha=0.6,
            label="tool calls per answer")
    ax.set_xlabel("optimizer step")
    ax.set_ylim(0, 1.05)
    ax.set_title("AIPO (staleness 1): learning to call a calculator")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="outputs/tool_calling_cpu")
    parser.add_argument("--model", default=None, help="model directory (built and warmed up here if missing)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--report-to", default="none")
    args = parser.parse_args()

    model_dir = prepare_tool_model(args.model or os.path.join(args.output_dir, "tiny-qwen3-tools"))
    config = AsyncAIPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=32,  # 4 prompts x 8 completions per step
        num_generations=8,
        max_completion_length=96,  # a call (~32 tokens), the tool's result (~20, not trained), the answer
        max_tool_calling_iterations=1,
        chat_template_kwargs={"enable_thinking": False},
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=args.report_to,
        max_staleness=args.max_staleness,
        seed=0,
    )
    trainer = AsyncAIPOTrainer(model=model_dir, reward_funcs="math_sympy", args=config, tools=[calculator],
                               train_dataset=Dataset.from_list(calculator_rows(4096, seed=1)))
    trainer.train()
    if trainer.state is None or not trainer.state.is_world_process_zero:
        return  # generator ranks and non-zero trainer ranks are done
    rows = [r for r in trainer.state.log_history if "reward" in r]
    first, last = _mean(rows[:10], "reward"), _mean(rows[-10:], "reward")
    png = os.path.join(args.output_dir, "reward_curve.png")
    plot(trainer.state.log_history, png)
    summary = {
        "reward_first_10": round(first, 4), "reward_last_10": round(last, 4),
        "tool_calls_first_10": round(_mean(rows[:10], "tools/call_frequency"), 4),
        "tool_calls_last_10": round(_mean(rows[-10:], "tools/call_frequency"), 4),
        "steps": len(rows), "train_runtime_s": trainer.state.log_history[-1].get("train_runtime"),
        "reward_curve_png": png,
    }
    print(f"reward: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
    print(f"tool calls per answer: {summary['tool_calls_first_10']:.2f} -> {summary['tool_calls_last_10']:.2f}")
    print(f"reward curve: {png}")
    print(json.dumps(summary))


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else 0.0


if __name__ == "__main__":
    main()
