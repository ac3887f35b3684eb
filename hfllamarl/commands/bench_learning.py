"""`hfllamarl bench learning`: the staleness study. Does asynchrony cost learning, for each loss and correction?

    hfllamarl bench learning [--quick] [--seeds 0,1,2,3,4] [--jobs 2] [--output-dir outputs/bench_learning]
    hfllamarl bench learning --runtime [--seeds ...]    # the same question on the asynchronous runtime itself

The grid (`hfllamarl.study.grid.plan`), on two tasks (`hfllamarl.study.tasks`: `successor`, the demo task, and
`increment`, a harder one a tiny model improves at over several hundred steps):

(a) on both tasks, every loss (AIPO and every TRL `loss_type`, and GSPO) synchronous and with its default
    correction at staleness 4 and 16, and AIPO without any correction at 16;
(b) on `successor`, AIPO and GRPO with every correction (`off_policy_correction`) at staleness 1, 4 and 16.

Each run is the product's trainer fed batches exactly `s` versions old (`hfllamarl.study.lockstep`): deterministic
for a seed, one thread, `--jobs` runs at once. Per cell: the final reward (mean reward of the last tenth of the
steps) and the area under the curve, mean and 95 % confidence interval over the seeds, the share of the same loss's
synchronous final reward (95 % bootstrap interval), importance-ratio statistics, the share of tokens the correction
bounded, the behaviour KL. Written to the output directory: `runs.jsonl` (a JSON line per run: the grid resumes
from it), `cells.jsonl` (a line per cell), `summary.json`, `table.md` and `figures/*.png`; the table is printed and
the last line is the summary's JSON.

`--runtime` answers the same question on the real asynchronous runtime (a vLLM generator process, the weight sync,
the overlap): the synchronous run and AIPO's default at `--staleness`, per task, one run at a time.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys


def add_arguments(parser) -> None:
    parser.add_argument("--output-dir", default="outputs/bench_learning")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds; every cell runs each")
    parser.add_argument("--tasks", default="successor,increment", help="(a)'s tasks, among successor, increment")
    parser.add_argument("--losses", default="aipo,grpo,bnpo,dr_grpo,dapo,cispo,sapo,luspo,vespo,gspo,gspo_paper",
                        help="(a)'s losses: aipo, a TRL loss_type, gspo (TRL's sequence-level ratio) or gspo_paper "
                             "(GSPO with the paper's clip range, as TRL's docs configure it)")
    parser.add_argument("--staleness", default="4,16", help="(a)'s staleness levels (each loss's default correction)")
    parser.add_argument("--correction-task", default="successor", help="(b)'s task ('' to skip (b))")
    parser.add_argument("--correction-losses", default="aipo,grpo", help="(b)'s losses")
    parser.add_argument("--corrections", default=None,
                        help="(b)'s corrections (default: all built-ins; '<name>+ess' adds VCPO's step rule to one; "
                             "options as 'name:option=value', e.g. 'a3po:lag=4'; with options, separate by ';')")
    parser.add_argument("--correction-staleness", default="1,4,16", help="(b)'s staleness levels")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the task's)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--quick", action="store_true",
                        help="a few minutes: successor, AIPO and GRPO, staleness 4, no correction vs the default, 3 "
                             "seeds x 100 steps")
    parser.add_argument("--report-only", action="store_true", help="write the outputs from runs.jsonl, run nothing")
    parser.add_argument("--runtime", action="store_true",
                        help="the asynchronous runtime itself (vLLM generator, weight sync, overlap): the synchronous "
                             "run and AIPO at each --staleness, per task")


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what} {text!r}: give comma-separated whole numbers, e.g. 0,1,2") from None


def _names(text: str | None, choices, what: str) -> list[str]:
    raw = text or ""
    names = [x.strip() for x in raw.split(";" if ";" in raw else ",") if x.strip()]
    from hfllamarl.study.grid import split_lookahead

    unknown = [n for n in names if split_lookahead(n)[0].split(":")[0] not in choices]
    if unknown:
        raise SystemExit(f"{what}: unknown {unknown}; choose among {', '.join(choices)}")
    return names


def machine() -> str:
    """The CPU and its core count, for the record."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            name = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def run(args) -> int:
    from hfllamarl.study import grid, report
    from hfllamarl.study.tasks import TASKS

    if args.quick:
        args.tasks, args.losses, args.staleness = "successor", "aipo,grpo", "4"
        args.correction_task, args.correction_losses, args.corrections = "successor", "aipo", "none"
        args.correction_staleness, args.steps = "4", args.steps or 100
        args.seeds = args.seeds if args.seeds != "0,1,2,3,4" else "0,1,2"
    seeds = _ints(args.seeds, "--seeds")
    if not seeds or (args.steps is not None and args.steps < 2) or args.jobs < 1:
        raise SystemExit("give at least one seed, --steps >= 2 and --jobs >= 1")
    tasks = _names(args.tasks, TASKS, "--tasks")
    os.makedirs(args.output_dir, exist_ok=True)
    if args.runtime:
        return run_runtime(args, tasks, seeds)
    cells = grid.plan(tasks, _names(args.losses, grid.LOSSES, "--losses"), _ints(args.staleness, "--staleness"),
                      args.correction_task or None, _names(args.correction_losses, grid.LOSSES, "--correction-losses"),
                      _names(args.corrections or ",".join(grid.CORRECTIONS), grid.KNOWN_CORRECTIONS, "--corrections"),
                      _ints(args.correction_staleness, "--correction-staleness"))
    if args.correction_task and args.correction_task not in TASKS:
        raise SystemExit(f"--correction-task {args.correction_task!r}: choose among {', '.join(TASKS)}")
    used = sorted({c.task for c in cells})
    models = {t: TASKS[t].prepare_model(os.path.join(args.output_dir, "models", t)) for t in used}
    budgets = {t: {"steps": args.steps or TASKS[t].steps, "learning_rate": TASKS[t].learning_rate,
                   "max_completion_length": TASKS[t].max_completion_length} for t in used}
    print(f"{len(cells)} cells x {len(seeds)} seeds on {machine()}; runs in {args.output_dir}/runs.jsonl", flush=True)
    runs = grid.done_runs(os.path.join(args.output_dir, "runs.jsonl"))
    if not args.report_only:
        runs = grid.run_grid(cells, seeds, args.output_dir, models, budgets, args.jobs,
                             log=lambda line: print(line, flush=True))
    wanted = {c.key for c in cells}
    runs = {k: v for k, v in runs.items() if k[0] in wanted and k[1] in seeds}
    failed = [f"{r['cell']} seed {r['seed']}: {r['error']}" for r in runs.values() if "error" in r]
    summary = report.write(runs, args.output_dir, machine())
    print(open(summary["table"]).read())
    for line in failed:
        print(f"FAILED {line}")
    print(json.dumps(summary))
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------ --runtime
def run_runtime(args, tasks: list[str], seeds: list[int]) -> int:
    """The synchronous run and AIPO's default at each staleness, per task and seed, on the real runtime (a vLLM
    generator child of each run), one run at a time; the same outputs as the grid."""
    from hfllamarl.study import grid, report
    from hfllamarl.study.lockstep import SERIES
    from hfllamarl.study.stats import final_reward
    from hfllamarl.study.tasks import TASKS

    levels = [0] + [s for s in _ints(args.staleness, "--staleness") if s]
    path = os.path.join(args.output_dir, "runs.jsonl")
    runs = grid.done_runs(path)
    for seed in seeds:
        for task in tasks:
            model = TASKS[task].prepare_model(os.path.join(args.output_dir, "models", task))
            for s in levels:
                cell = grid.Cell(task, "aipo", grid.default_correction("aipo", s), s)
                if (cell.key, seed) in runs:
                    continue
                steps = args.steps or TASKS[task].steps
                job = {"task": task, "model": model, "config": cell.config(
                    seed, steps, TASKS[task].learning_rate, TASKS[task].max_completion_length,
                    os.path.join(args.output_dir, "scratch", f"{task}-s{s}-seed{seed}")),
                       "history": os.path.join(args.output_dir, "scratch", f"{task}-s{s}-seed{seed}.json")}
                print(f"runtime: {cell.key} seed {seed} ...", flush=True)
                proc = subprocess.run([sys.executable, "-m", "hfllamarl.commands.bench_learning", json.dumps(job)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                record = {"cell": cell.key, "task": task, "loss": "aipo", "correction": cell.correction,
                          "staleness": s, "seed": seed, "steps": steps}
                if proc.returncode != 0:
                    record["error"] = proc.stderr[-2000:]
                else:
                    history = json.load(open(job["history"]))
                    logged = [h for h in history if "reward" in h]
                    record["series"] = {name: [h.get(name) for h in logged] for name in SERIES
                                        if any(name in h for h in logged)}
                    record["seconds"] = next((h["train_runtime"] for h in history if "train_runtime" in h), None)
                with open(path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                runs[(cell.key, seed)] = record
                done = record.get("error") or f"final reward {final_reward(record['series']['reward']):.3f}"
                print(f"  {done}", flush=True)
    summary = report.write(runs, args.output_dir, machine() + " (runtime)")
    print(open(summary["table"]).read())
    print(json.dumps(summary))
    return 0


def train_runtime(job: dict) -> None:
    """Child process of --runtime: one run under plain python (the trainer; its generator is its own child)."""
    from datasets import Dataset

    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
    from hfllamarl.study.tasks import TASKS

    task = TASKS[job["task"]]
    config = AsyncAIPOConfig(**job["config"], logging_steps=1, save_strategy="no", report_to="none",
                             disable_tqdm=True, collective_timeout_s=600,
                             bootstrap_generation=False)  # (every batch comes from the generator: staleness as set)
    trainer = AsyncAIPOTrainer(model=job["model"], reward_funcs=task.reward, args=config,
                               train_dataset=Dataset.from_list(task.rows()))
    trainer.train()
    with open(job["history"], "w") as fh:
        json.dump(trainer.state.log_history, fh)


if __name__ == "__main__":
    train_runtime(json.loads(sys.argv[1]))
