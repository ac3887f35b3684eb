"""`hfllamarl bench replica-groups`: what trainer replica groups cost a training run without failures, side by side
with today's layout.

    hfllamarl bench replica-groups [--steps 40] [--rounds 2] [--warmup 10] [--precision auto] [--shared-generators]

The vs-TRL bench's task and model (a random-init Llama, 18.7M parameters by default; the digit-share reward; 4
prompts x 4 completions of up to 96 tokens a step, constant learning rate 1e-4, max_staleness 1), trained by the
real trainer in two layouts of 2 trainer ranks and 2 generators, alternated `--rounds` times:

- `hybrid` (today's): one `torchrun --nproc-per-node 4` job, 2 trainer ranks with `trainer_fsdp_shard_size=1`
  (hybrid sharding: FSDP2 averages the gradients in the backward pass) and 2 generator replicas of one process;
- `groups` (fault-tolerant): 2 jobs of `torchrun --nproc-per-node 2` (1 trainer + 1 generator each) with
  `trainer_replica_groups=2`, joined per step by torchft's quorum through a lighthouse this process starts.

With `--shared-generators`, 2 trainer ranks and 1 generator: `hybrid` is one job of 3 processes; `groups` is group 0
(1 trainer + the generator, `torchrun --nproc-per-node 2`) and group 1 (one trainer process, started with plain
`python`), with `trainer_replica_shared_generators=True`: group 0's generator samples both shares and group 0's
trainer hands group 1 its share each step.

Both train the same global batch a step (2 x 8 completions). It prints each layout's steady seconds a step (the
first trainer's step ends from step `--warmup` on: the whole run's pace, generation and weight sync included), the
ratio, and the groups' own seconds a step in the quorum's calls (`time/replica_quorum`: the quorum, the token count,
the commit vote, each with its wait for the slower group) and in the gradient average (`time/replica_average`), and
one JSON line. torchft 0.2.0 must be installed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROWS_PER_GROUP = 8  # completions each of the 2 trainer ranks trains a step (2 prompts x 4)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="each layout runs this many times, alternated")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the steady pace")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--shared-generators", action="store_true",
                        help="2 trainer ranks + 1 generator: the groups share group 0's (trainer_replica_shared_generators)")
    parser.add_argument("--output-dir", default="outputs/bench_replica_groups")


def child(job: dict) -> None:
    """One rank of one layout's job (under torchrun): trains; the first trainer rank writes its step ends and log."""
    from transformers import TrainerCallback

    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
    from hfllamarl.commands.bench_vs_trl import _dataset, digit_share

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.time())

    config = AsyncAIPOConfig(
        output_dir=job["output_dir"], max_steps=job["steps"], per_device_train_batch_size=ROWS_PER_GROUP,
        num_generations=4, max_completion_length=96, learning_rate=1e-4, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to="none", seed=0, bf16=job["precision"] == "bf16",
        beta=0.0, temperature=1.0, scale_rewards="group", max_staleness=1, disable_tqdm=True,
        bootstrap_generation=False, **job["layout_config"])
    trainer = AsyncAIPOTrainer(model=job["model"], reward_funcs=digit_share, train_dataset=_dataset(0), args=config,
                               callbacks=[StepClock()])
    trainer.train()
    if trainer.state is not None and trainer.state.is_world_process_zero:
        with open(job["result"], "w") as fh:
            json.dump({"ends": ends, "history": [h for h in trainer.state.log_history if "step_time" in h]}, fh)


def _torchrun(nproc: int, job: dict, log: str) -> subprocess.Popen:
    """One layout's job: `nproc` processes under torchrun (0: one process started with plain python)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("RUST_LOG", "warn")
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc else []
    if not nproc:  # (one thread, as torchrun gives each of its ranks: not two processes' threads on one core)
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, *launch, "-m", __name__, json.dumps(job)]
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)


def run_layout(layout: str, job: dict, out: str, round_: int, shared: bool = False) -> dict:
    """One run of `layout`; the first trainer's result (group 0's for `groups`). `shared`: 1 generator (group 0's)."""
    lighthouse = None
    runs = []  # (process, log, result)
    if layout == "groups":
        from hfllamarl.runtime.training.replica_quorum import start_lighthouse

        # (both groups in every quorum: neither starts late and copies the other, so both train every step)
        lighthouse = start_lighthouse(min_replicas=2, heartbeat_timeout_s=5.0, join_timeout_s=5.0)
        for g in range(2):
            where = os.path.join(out, f"{layout}-{round_}-g{g}")
            spec = dict(job, output_dir=where, result=where + ".json", layout_config={
                "trainer_replica_groups": 2, "trainer_replica_group": g, "torchft_lighthouse": lighthouse.address(),
                "trainer_replica_shared_generators": shared})
            runs.append((_torchrun(0 if shared and g else 2, spec, where + ".log"), where + ".log", spec["result"]))
    else:
        where = os.path.join(out, f"{layout}-{round_}")
        spec = dict(job, output_dir=where, result=where + ".json",
                    layout_config={"trainer_fsdp_shard_size": 1, "num_generator_processes": 1 if shared else 2,
                                   "generator_tensor_parallel_size": 1})
        runs.append((_torchrun(3 if shared else 4, spec, where + ".log"), where + ".log", spec["result"]))
    try:
        for proc, _, _ in runs:
            proc.wait(timeout=1800)
    finally:
        for proc, _, _ in runs:
            if proc.poll() is None:
                proc.kill()
        if lighthouse is not None:
            lighthouse.shutdown()
    for proc, log, _ in runs:
        if proc.returncode:
            with open(log) as fh:
                raise SystemExit(f"{layout} failed (exit {proc.returncode}):\n{fh.read()[-3000:]}")
    with open(runs[0][2]) as fh:
        return json.load(fh)


def pace(result: dict, warmup: int) -> float:
    """Seconds a step from the end of step `warmup` to the last one."""
    ends = result["ends"]
    if len(ends) <= warmup + 1:
        raise SystemExit(f"give --steps > --warmup + 1 (the run had {len(ends)} steps)")
    return (ends[-1] - ends[warmup]) / (len(ends) - 1 - warmup)


def run(args) -> int:
    from hfllamarl.commands.bench_vs_trl import bench_model
    from hfllamarl.runtime.generation.preflight import cpu_has_bf16
    from hfllamarl.runtime.training.replica_quorum import import_torchft

    os.environ.setdefault("RUST_LOG", "warn")  # (the lighthouse, in this process, logs every quorum at INFO)
    import_torchft()  # (a missing torchft is named before anything starts)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        raise SystemExit("give --steps >= 1, --rounds >= 1 and --warmup >= 0")
    precision = ("bf16" if cpu_has_bf16() else "fp32") if args.precision == "auto" else args.precision
    os.makedirs(args.output_dir, exist_ok=True)
    model = bench_model(args.output_dir, args.hidden_size, args.layers, seed=0)
    job = {"model": model, "steps": args.steps, "precision": precision}
    paces = {"hybrid": [], "groups": []}
    quorum, average = [], []
    with tempfile.TemporaryDirectory(dir=args.output_dir) as out:
        for round_ in range(args.rounds):
            for layout in ("hybrid", "groups"):
                print(f"round {round_ + 1}: {layout} ...", flush=True)
                r = run_layout(layout, job, out, round_, args.shared_generators)
                paces[layout].append(pace(r, args.warmup))
                print(f"  {paces[layout][-1]:.3f} s a step", flush=True)
                if layout == "groups":
                    steady = r["history"][args.warmup:]
                    quorum += [h["time/replica_quorum"] for h in steady if "time/replica_quorum" in h]
                    average += [h["time/replica_average"] for h in steady if "time/replica_average" in h]
    mean = {k: statistics.mean(v) for k, v in paces.items()}
    ratio = mean["groups"] / mean["hybrid"]
    q_med, q_mean = statistics.median(quorum), statistics.mean(quorum)
    shared = args.shared_generators
    print(f"\n2 trainer ranks + {1 if shared else 2} generator(s), {2 * ROWS_PER_GROUP} completions of up to 96 tokens "
          f"a step, {precision}, {args.rounds} x {args.steps} steps per layout (steps {args.warmup + 1}-{args.steps} "
          "timed)")
    print(f"  hybrid (one torchrun job, trainer_fsdp_shard_size=1)   {mean['hybrid']:.3f} s a step  "
          f"(runs: {', '.join(f'{p:.3f}' for p in paces['hybrid'])})")
    groups = "2 jobs sharing group 0's generator" if shared else "2 torchrun jobs"
    print(f"  groups ({groups}, torchft quorum){' ' * max(1, 38 - len(groups))}{mean['groups']:.3f} s a step  "
          f"(runs: {', '.join(f'{p:.3f}' for p in paces['groups'])})   {ratio:.3f}x")
    print(f"    the groups' quorum calls a step (with their waits for the slower group): median {q_med:.4f} s, "
          f"mean {q_mean:.4f} s ({q_mean / mean['groups']:.1%} of the step); gradient average: median "
          f"{statistics.median(average):.4f} s")
    print(json.dumps({"precision": precision, "shared_generators": shared, "steps": args.steps,
                      "rounds": args.rounds, "warmup": args.warmup,
                      "hybrid_step_s": round(mean["hybrid"], 4), "groups_step_s": round(mean["groups"], 4),
                      "ratio": round(ratio, 4), "quorum_median_s": round(q_med, 4), "quorum_mean_s": round(q_mean, 4),
                      "average_median_s": round(statistics.median(average), 4)}))
    return 0


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
