"""`hfllamarl bench multi-turn`: multi-turn tool-calling RL, synchronous vs asynchronous, on this machine.

    hfllamarl bench multi-turn [--steps 20] [--tool-latency 0.5] [--variants sync,async,async_partial]

The job is the CPU example's (`examples/tool_calling_cpu.py`): the tiny Qwen3-template model warmed up on the
calculator task (only the first phase of its warm-up, so that it calls the tool in most answers), `tools=[calculator]`,
32 completions per step (4 prompts x 8), up to 96 tokens each, one tool-calling round. The calculator waits
`--tool-latency` seconds before it answers, standing for a real tool (a sandbox, a search API); the calls of one round
run concurrently. The learning rate is 0 by default: the trainer does all its work (forward, backward, optimizer
step, weight sync) but the policy stays the same, so every variant samples the same workload and the ratio measures
the runtime, not a difference in what the policies learned to do. Each variant runs in a fresh process:

- `sync`: `max_staleness=0`, generation (with its tool calls) then training, alternating: the baseline;
- `async`: `max_staleness=1`, generation of step k+1 (tools included) overlaps training on step k;
- `async_partial`: `max_staleness=2`, `partial_rollout_tokens=48`: a rollout stops after 48 sampled tokens per tick
  and continues at the next tick under newer weights, so no tick waits for the longest rollout.

It prints, per variant, the steady-state seconds per step (steps 2..N: start-up left out), completions per
second, sampled tokens per second, tool calls per completion and the final reward, then each asynchronous
variant's throughput over the synchronous one. The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import time

VARIANTS = {
    "sync": {"max_staleness": 0},
    "async": {"max_staleness": 1},
    "async_partial": {"max_staleness": 2, "partial_rollout_tokens": 48},
}
PROMPTS_PER_STEP, NUM_GENERATIONS, LENGTH = 4, 8, 96


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per variant")
    parser.add_argument("--tool-latency", type=float, default=0.5, help="seconds the calculator takes per call")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--learning-rate", type=float, default=0.0,
                        help="0 (default): the policy stays as it is, so every variant samples the same workload")
    parser.add_argument("--model", default=None, help="the tool model (default: built once: the CPU example's model "
                        "before it learns to call the tool rarely, so most rollouts call it)")
    parser.add_argument("--output-dir", default="outputs/bench_multi_turn")


def _calculator(latency: float):
    """The calculator tool, answering after `latency` seconds (a closure: it travels to the generator by value)."""
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "12+30".
        """
        from hfllamarl.plugins.environments.calculator import evaluate

        time.sleep(latency)
        return evaluate(expression)

    return calculator


def run_variant(job: dict) -> None:
    """Child process: one variant, timed; writes its result to `job["result"]`."""
    from datasets import Dataset

    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
    from hfllamarl.commands.bench_vs_trl import _callback, _Clock
    from hfllamarl.testing.tiny_chat import calculator_rows

    clock = _Clock()
    config = AsyncAIPOConfig(
        output_dir=job["output_dir"], max_steps=job["steps"], per_device_train_batch_size=PROMPTS_PER_STEP *
        NUM_GENERATIONS, num_generations=NUM_GENERATIONS, max_completion_length=LENGTH, max_tool_calling_iterations=1,
        chat_template_kwargs={"enable_thinking": False}, learning_rate=job["learning_rate"],
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", seed=0,
        disable_tqdm=True, **VARIANTS[job["variant"]])
    trainer = AsyncAIPOTrainer(model=job["model"], reward_funcs="math_sympy", args=config,
                               tools=[_calculator(job["tool_latency"])], callbacks=[_callback(clock)],
                               train_dataset=Dataset.from_list(calculator_rows(4096, seed=1)))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    history = [h for h in trainer.state.log_history if "reward" in h]
    with open(job["result"], "w") as fh:
        json.dump({"seconds": seconds, "steps": clock.steps and [t - start for t in clock.steps],
                   "history": history}, fh)


def _summary(r: dict, steps: int) -> dict:
    ends = r["steps"]
    steady = (ends[-1] - ends[0]) / (len(ends) - 1)  # seconds per step after the first (start-up left out)
    h = r["history"][1:] or r["history"]
    tokens = sum(x["completions/mean_length"] for x in h) / len(h) * PROMPTS_PER_STEP * NUM_GENERATIONS
    quarter = max(steps // 4, 1)
    return {"step_s": round(steady, 3), "completions_per_s": round(PROMPTS_PER_STEP * NUM_GENERATIONS / steady, 2),
            "sampled_tokens_per_s": round(tokens / steady, 1),
            "tool_calls_per_completion": round(sum(x["tools/call_frequency"] for x in h) / len(h), 3),
            "final_reward": round(sum(x["reward"] for x in r["history"][-quarter:]) / quarter, 3),
            "train_s": round(r["seconds"], 1), "first_step_s": round(ends[0], 1)}


def run(args) -> int:
    from hfllamarl.commands.bench_vs_trl import run_job
    from hfllamarl.testing.tiny_chat import prepare_tool_model

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants {args.variants!r}: choose from {', '.join(VARIANTS)}")
    if args.steps < 3 or args.tool_latency < 0:
        raise SystemExit("give --steps >= 3 and --tool-latency >= 0")
    os.makedirs(args.output_dir, exist_ok=True)
    model = args.model or prepare_tool_model(os.path.join(args.output_dir, "tiny-qwen3-tools-calling"), decide_steps=0)
    results = {}
    for variant in variants:
        job = {"variant": variant, "model": model, "steps": args.steps, "tool_latency": args.tool_latency,
               "learning_rate": args.learning_rate, "output_dir": os.path.join(args.output_dir, variant),
               "result": os.path.join(args.output_dir, f"{variant}.json")}
        print(f"running {variant} ...", flush=True)
        results[variant] = _summary(run_job("hfllamarl.commands.bench_multi_turn", job, variant), args.steps)
    print(f"\ncalculator task, {args.steps} steps of {PROMPTS_PER_STEP * NUM_GENERATIONS} completions (up to "
          f"{LENGTH} tokens, 1 tool round), tool latency {args.tool_latency} s, {os.cpu_count()} cores")
    print(f"{'variant':<16}{'s/step':>8}{'compl/s':>9}{'tokens/s':>10}{'calls/compl':>13}{'final reward':>14}")
    for variant, s in results.items():
        print(f"{variant:<16}{s['step_s']:>8.2f}{s['completions_per_s']:>9.2f}{s['sampled_tokens_per_s']:>10.1f}"
              f"{s['tool_calls_per_completion']:>13.2f}{s['final_reward']:>14.3f}")
    out = {**results, "steps": args.steps, "tool_latency_s": args.tool_latency, "cores": os.cpu_count()}
    if "sync" in results:
        for variant in results:
            if variant != "sync":
                ratio = results[variant]["completions_per_s"] / results["sync"]["completions_per_s"]
                out[f"ratio_{variant}"] = round(ratio, 3)
                print(f"{variant} / sync throughput: {ratio:.2f}x")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    run_variant(json.loads(sys.argv[1]))
