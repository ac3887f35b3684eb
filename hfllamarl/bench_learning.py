"""`hfllamarl bench learning`: does learning survive asynchrony? The demo task, four ways.

    hfllamarl bench learning [--steps 300] [--output-dir outputs/bench_learning]

Each variant trains the same tiny model (built and format-warmed locally) on the successor task
(`a+1=` -> `\\boxed{(a+1) mod 10}`, `math_sympy` reward) with the same seed and the same sample
budget (`--steps` x 64 completions), one generator process and one trainer process:

- `sync`: strictly on-policy (`max_staleness=0`, `on_policy_pg`): the paper's synchronous baseline;
- `aipo_staleness_1`, `aipo_staleness_4`: asynchronous, AIPO's clipped importance weight;
- `no_is_staleness_4`: asynchronous at staleness 4 without the importance weight (`on_policy_pg`).

It prints the mean reward over consecutive windows of samples, writes a PNG of the curves, and as
its last line one JSON object with each variant's final reward (mean of the last 10 steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

VARIANTS = {
    "sync": {"max_staleness": 0, "algorithm": "on_policy_pg"},
    "aipo_staleness_1": {"max_staleness": 1, "algorithm": "aipo"},
    "aipo_staleness_4": {"max_staleness": 4, "algorithm": "aipo"},
    "no_is_staleness_4": {"max_staleness": 4, "algorithm": "on_policy_pg"},
}


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per variant (64 completions each)")
    parser.add_argument("--output-dir", default="outputs/bench_learning")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)


def train_variant(job: dict) -> None:
    """Child process: one variant, in single-process mode (the generator is its child)."""
    from datasets import Dataset

    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
    from hfllamarl.tiny import successor_rows

    config = AsyncAIPOConfig(
        output_dir=job["output_dir"], max_steps=job["steps"], per_device_train_batch_size=64, num_generations=8,
        max_completion_length=4, learning_rate=job["learning_rate"], lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to="none", seed=job["seed"], collective_timeout_s=600,
        disable_tqdm=True, **VARIANTS[job["variant"]],
    )
    trainer = AsyncAIPOTrainer(model=job["model"], reward_funcs="math_sympy", args=config,
                               train_dataset=Dataset.from_list(successor_rows(4096, seed=1)))
    trainer.train()
    with open(job["history"], "w") as fh:
        json.dump(trainer.state.log_history, fh)


def plot(curves: dict[str, list[float]], path: str, completions_per_step: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rewards in curves.items():
        window = 10
        smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
                  for i in range(len(rewards))]
        ax.plot([(i + 1) * completions_per_step for i in range(len(rewards))], smooth, label=name)
    ax.set_xlabel("completions sampled")
    ax.set_ylabel("mean reward (10-step moving average)")
    ax.set_title("Learning vs staleness (successor task, same seed and budget)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args) -> int:
    from hfllamarl.tiny import prepare_demo_model

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; the variants are {list(VARIANTS)}")
    os.makedirs(args.output_dir, exist_ok=True)
    model = prepare_demo_model(os.path.join(args.output_dir, "tiny-llama"))
    curves, seconds = {}, {}
    for name in names:
        job = {"variant": name, "steps": args.steps, "learning_rate": args.learning_rate, "seed": args.seed,
               "model": model, "output_dir": os.path.join(args.output_dir, name),
               "history": os.path.join(args.output_dir, f"{name}.json")}
        print(f"training {name} ...", flush=True)
        proc = subprocess.run([sys.executable, "-m", "hfllamarl.bench_learning", json.dumps(job)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"variant {name} failed:\n{proc.stderr[-3000:]}")
        history = json.load(open(job["history"]))
        curves[name] = [h["reward"] for h in history if "reward" in h]
        seconds[name] = next((h["train_runtime"] for h in history if "train_runtime" in h), None)
    final = {name: round(sum(r[-10:]) / len(r[-10:]), 4) for name, r in curves.items()}
    png = os.path.join(args.output_dir, "learning.png")
    plot(curves, png, 64)
    windows = [w for w in (25, 50, 100, 150, 200, 250, 300, 400, 500) if w <= args.steps] or [args.steps]
    print(f"mean reward over steps (64 completions each), seed {args.seed}")
    print(f"{'variant':<20}" + "".join(f"{'<=' + str(w):>8}" for w in windows) + f"{'final':>8}{'seconds':>9}")
    for name, r in curves.items():
        cells = "".join(f"{sum(r[max(0, w - 25):w]) / len(r[max(0, w - 25):w]):>8.3f}" for w in windows)
        print(f"{name:<20}{cells}{final[name]:>8.3f}{seconds[name] or 0:>9.1f}")
    if "sync" in final and final["sync"] > 0:
        for name in final:
            if name != "sync":
                print(f"{name}: {100 * final[name] / final['sync']:.1f} % of sync")
    print(f"plot: {png}")
    print(json.dumps({**final, "steps": args.steps, "completions_per_step": 64, "plot": png}))
    return 0


if __name__ == "__main__":
    train_variant(json.loads(sys.argv[1]))
