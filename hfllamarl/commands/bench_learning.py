"""`hfllamarl bench learning`: does learning survive asynchrony? The demo task, four ways.

    hfllamarl bench learning [--steps 300] [--seeds 0,1,2] [--output-dir outputs/bench_learning]

Each variant trains the same tiny model (built and format-warmed locally) on the successor task
(`a+1=` -> `\\boxed{(a+1) mod 10}`, `math_sympy` reward) with the same seeds and the same sample
budget (`--steps` x 64 completions per seed), one generator process and one trainer process:

- `sync`: strictly on-policy (`max_staleness=0`, `on_policy_pg`): the paper's synchronous baseline;
- `aipo_staleness_1`, `aipo_staleness_4`: asynchronous, AIPO's clipped importance weight;
- `no_is_staleness_4`: asynchronous at staleness 4 without the importance weight (`on_policy_pg`);
- `aipo_staleness_4_partial`: AIPO at staleness 4 with partial rollouts of one token per tick (a
  completion's later tokens are sampled by newer policies);
- on request (`--variants`), TRL's loss menu at staleness 4 (`algorithm="grpo"`): `dr_grpo_staleness_4`,
  `cispo_staleness_4` (epsilon_high 5) and `gspo_staleness_4` (sequence-level ratio and weight).

A variant's final reward is the mean reward of its last tenth of steps (at least 10), averaged over
the seeds. It prints the mean reward over windows of samples and each seed's final reward, writes a
PNG of the seed-averaged curves, and as its last line one JSON object with each variant's final reward.
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
    "aipo_staleness_4_partial": {"max_staleness": 4, "algorithm": "aipo", "partial_rollout_tokens": 1},
    # TRL's loss menu (algorithm="grpo": TRL's loss, its vLLM importance-sampling weight correcting the staleness)
    "dr_grpo_staleness_4": {"max_staleness": 4, "algorithm": "grpo", "loss_type": "dr_grpo"},
    "cispo_staleness_4": {"max_staleness": 4, "algorithm": "grpo", "loss_type": "cispo", "epsilon_high": 5.0},
    "gspo_staleness_4": {"max_staleness": 4, "algorithm": "grpo", "loss_type": "grpo",
                         "importance_sampling_level": "sequence", "vllm_importance_sampling_mode": "sequence_truncate"},
}
DEFAULT_VARIANTS = ("sync", "aipo_staleness_1", "aipo_staleness_4", "no_is_staleness_4", "aipo_staleness_4_partial")
COMPLETIONS_PER_STEP = 64


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per variant (64 completions each)")
    parser.add_argument("--output-dir", default="outputs/bench_learning")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="comma-separated, among " + ",".join(VARIANTS))
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every variant runs with each")


def train_variant(job: dict) -> None:
    """Child process: one variant, in single-process mode (the generator is its child)."""
    from datasets import Dataset

    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
    from hfllamarl.testing.tiny import successor_rows

    config = AsyncAIPOConfig(
        output_dir=job["output_dir"], max_steps=job["steps"], per_device_train_batch_size=COMPLETIONS_PER_STEP,
        num_generations=8,
        max_completion_length=4, learning_rate=job["learning_rate"], lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to="none", seed=job["seed"], collective_timeout_s=600,
        disable_tqdm=True, **VARIANTS[job["variant"]],
        bootstrap_generation=False,  # (the variants compare staleness: every batch comes from the generator)
    )
    trainer = AsyncAIPOTrainer(model=job["model"], reward_funcs="math_sympy", args=config,
                               train_dataset=Dataset.from_list(successor_rows(4096, seed=1)))
    trainer.train()
    with open(job["history"], "w") as fh:
        json.dump(trainer.state.log_history, fh)


def plot(curves: dict[str, list[float]], path: str, completions_per_step: int, num_seeds: int) -> None:
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
    ax.set_ylabel(f"mean reward ({num_seeds} seeds, 10-step moving average)")
    ax.set_title("Learning vs staleness (successor task, same seeds and budget)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def final_reward(rewards: list[float]) -> float:
    """Mean reward of the last tenth of the steps (at least 10)."""
    tail = rewards[-max(10, len(rewards) // 10):]
    return sum(tail) / len(tail)


def mean_curve(curves: list[list[float]]) -> list[float]:
    return [sum(c[i] for c in curves) / len(curves) for i in range(min(map(len, curves)))]


def run(args) -> int:
    from hfllamarl.testing.tiny import prepare_demo_model

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; the variants are {list(VARIANTS)}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--seeds {args.seeds!r}: give comma-separated whole numbers, e.g. 0,1,2") from None
    if not seeds or args.steps < 1:
        raise SystemExit("give at least one seed and --steps >= 1")
    os.makedirs(args.output_dir, exist_ok=True)
    model = prepare_demo_model(os.path.join(args.output_dir, "tiny-llama"))
    curves: dict[str, dict[int, list[float]]] = {name: {} for name in names}
    seconds: dict[str, float] = {name: 0.0 for name in names}
    for seed in seeds:
        for name in names:
            tag = f"{name}-seed{seed}"
            job = {"variant": name, "steps": args.steps, "learning_rate": args.learning_rate, "seed": seed,
                   "model": model, "output_dir": os.path.join(args.output_dir, tag),
                   "history": os.path.join(args.output_dir, f"{tag}.json")}
            print(f"training {name}, seed {seed} ...", flush=True)
            proc = subprocess.run([sys.executable, "-m", "hfllamarl.commands.bench_learning", json.dumps(job)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"variant {name} (seed {seed}) failed:\n{proc.stderr[-3000:]}")
            history = json.load(open(job["history"]))
            curves[name][seed] = [h["reward"] for h in history if "reward" in h]
            seconds[name] += next((h["train_runtime"] for h in history if "train_runtime" in h), 0.0)
    means = {name: mean_curve(list(per_seed.values())) for name, per_seed in curves.items()}
    final = {name: round(sum(final_reward(c) for c in per_seed.values()) / len(seeds), 4)
             for name, per_seed in curves.items()}
    png = os.path.join(args.output_dir, "learning.png")
    plot(means, png, COMPLETIONS_PER_STEP, len(seeds))
    windows = sorted({min(args.steps, max(1, round(args.steps * f / 6))) for f in range(1, 7)})
    print(f"mean reward over {len(seeds)} seed(s) {seeds}, by completions sampled ({COMPLETIONS_PER_STEP} per step; "
          "each cell: the mean of the steps since the previous column)")
    print(f"{'variant':<26}" + "".join(f"{w * COMPLETIONS_PER_STEP:>8}" for w in windows) + f"{'final':>8}"
          + "".join(f"{'seed ' + str(s):>8}" for s in seeds) + f"{'% sync':>8}{'seconds':>9}")
    prev = [0] + windows[:-1]
    for name, r in means.items():
        cells = "".join(f"{sum(r[a:b]) / max(b - a, 1):>8.3f}" for a, b in zip(prev, windows))
        per_seed = "".join(f"{final_reward(curves[name][s]):>8.3f}" for s in seeds)
        share = f"{100 * final[name] / final['sync']:>7.1f}%" if final.get("sync") else f"{'-':>8}"
        print(f"{name:<26}{cells}{final[name]:>8.3f}{per_seed}{share}{seconds[name] / len(seeds):>9.1f}")
    print(f"plot: {png}")
    print(json.dumps({**final, "steps": args.steps, "seeds": seeds, "completions_per_step": COMPLETIONS_PER_STEP,
                      "plot": png}))
    return 0


if __name__ == "__main__":
    train_variant(json.loads(sys.argv[1]))
