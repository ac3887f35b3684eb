"""`hfllamarl bench vs-trl`: TRL's `GRPOTrainer` and `AsyncAIPOTrainer` on the same job, one after the other.

    hfllamarl bench vs-trl [--steps 20] [--hidden-size 512] [--layers 6] [--precision auto|bf16|fp32]
                           [--profile] [--output-dir DIR]

Both sides get the same local model (a random-init Llama, 18M parameters by default, with the character tokenizer
of `hfllamarl.testing.tiny`), the same prompts, the same reward (the share of digits in a completion: a random
model's completions differ in it, so every step has a learning signal), the same advantage (TRL's default
`scale_rewards="group"`, where AIPO's own default is `"none"`), the same batch (16 completions per step, 4 per
prompt), the same completion length (96 tokens), learning rate, seed and number of steps, and the same precision
(`--precision`: `bf16`, GRPOConfig's default, is mixed precision on both sides, fp32 master weights and bf16
compute; `fp32` is `bf16=False` on both; `auto`, the default, is bf16 on a CPU with bf16 instructions, else fp32).
Each runs in a fresh process of its own, at its fastest honest setting on this machine:

- TRL: `GRPOTrainer` with transformers' generation (`use_vllm=False`; its colocated vLLM was slower here),
  every core for torch; under `bf16` its Trainer's autocast;
- hfllamarl: `AsyncAIPOTrainer` under plain `python` (one trainer, one vLLM generator child), `max_staleness=1`;
  under `bf16` FSDP2's bf16 mixed precision and a bf16 generator.

It prints each side's `train()` wall time, steps/s, time to the first step, final reward (the mean reward of
the last quarter of the steps), the trainer's construction (`init s`: the config, the data set and the trainer)
and the whole process (`process s`: imports, construction, `train()`, exit), and the ratios of `train()`, of
construction + `train()` and of the whole processes; `--profile` adds a table of where a step's time goes on each
side. The last line is one JSON object. With `--seeds 0,1`, each side trains once per seed (the same model) and the
figures are means over the seeds; each seed's final rewards are printed side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

PROMPTS_PER_STEP, NUM_GENERATIONS = 4, 4


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps on each side")
    parser.add_argument("--hidden-size", type=int, default=512, help="model width (512 x 6 layers: 18M parameters)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-completion-length", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="put a fixed instruction of this many tokens before every prompt (a long system or "
                             "few-shot prompt; the bare prompts are 4 tokens): where the trainer's share_prompts "
                             "pays; at most 256 - 4 - --max-completion-length (the model's positions)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation (and the run's seed)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated run seeds: each side trains once per seed (same model); the final "
                             "rewards are compared per seed and on average (default: --seed alone)")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="both sides: bf16 mixed precision (GRPOConfig's bf16=True, its default) or fp32 "
                             "(bf16=False); auto: bf16 where the CPU has bf16 instructions (avx512_bf16 or AMX), "
                             "else fp32")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute activations in the backward pass on both sides (GRPOConfig's default; off "
                             "here: it costs a third more compute, and a model this size needs no memory saving)")
    parser.add_argument("--profile", action="store_true", help="also print where each side's step time goes")
    parser.add_argument("--bare-vllm", action="store_true",
                        help="also time a bare vLLM LLM.generate of one batch on one core (the generator's share) "
                             "and compare its tokens/s with the generator's")
    parser.add_argument("--preloaded", action="store_true",
                        help="the hfllamarl side forks its generator process from a preload server the bench starts "
                             "first (warm by the time that side runs), as on a machine that keeps one "
                             "(`hfllamarl preload`); without it the side's generator imports vLLM itself, as a "
                             "one-shot job's does")
    parser.add_argument("--sides", default="trl,hfllamarl", help="which sides to run (comma-separated)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="also run the hfllamarl side with these AsyncAIPOConfig fields, in the same invocation, "
                             "as a row of its own (hfllamarl-NAME); e.g. --variant 'sync={\"max_staleness\": 0}' "
                             "--variant 'lookahead={\"sampler_lookahead\": \"adamw\"}'")
    parser.add_argument("--output-dir", default="outputs/bench_vs_trl")


def _variants(specs: list[str]) -> dict[str, dict]:
    """`--variant NAME=JSON` -> {"hfllamarl-NAME": fields}. A name AsyncAIPOConfig does not have fails here, before
    any side runs; a value it refuses fails in the variant's own run (its checks need the whole job)."""
    import dataclasses
    import difflib

    from hfllamarl.trainers.config import AsyncAIPOConfig

    known = {f.name for f in dataclasses.fields(AsyncAIPOConfig)}
    out = {}
    for spec in specs:
        name, _, fields = spec.partition("=")
        try:
            value = json.loads(fields)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--variant {spec!r}: after NAME= give a JSON object of AsyncAIPOConfig fields ({exc})")
        if not name.strip() or not isinstance(value, dict):
            raise SystemExit(f"--variant {spec!r}: give NAME={{\"field\": value, ...}}")
        for field in value:
            if field not in known:
                near = difflib.get_close_matches(field, sorted(known), n=3)
                raise SystemExit(f"--variant {spec!r}: AsyncAIPOConfig has no field {field!r}"
                                 + (f" (did you mean {', '.join(near)}?)" if near else ""))
        out[f"hfllamarl-{name.strip()}"] = value
    return out


def run_job(module: str, job: dict, name: str) -> dict:
    """Run `python -m module JOB` in a fresh process (no launcher variables, torch's own thread count) and return
    the JSON it wrote to `job["result"]`; a failure ends the bench with the job's last error lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, json.dumps(job)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    with open(job["result"]) as fh:
        return {**json.load(fh), "process_seconds": time.perf_counter() - began}


def digit_share(completions, **kwargs) -> list[float]:
    """The reward: the share of a completion's characters that are digits (TRL's reward-function contract)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


PREAMBLE = "add one to the number and answer with its digits only, as in the examples before. "


def preamble(tokens: int) -> str:
    """A fixed instruction of `tokens` characters (the bench's tokenizer has one token per character) put before
    every prompt, as a long system or few-shot prompt is (`--prompt-tokens`)."""
    return (PREAMBLE * (tokens // len(PREAMBLE) + 1))[:tokens]


def _dataset(seed: int, prefix: str = ""):
    from datasets import Dataset

    from hfllamarl.testing.tiny import successor_rows

    return Dataset.from_list([{"prompt": prefix + r["prompt"]} for r in successor_rows(4096, seed=seed)])


def _common(job: dict) -> dict:
    """The settings both sides share, under their `GRPOConfig` names."""
    return dict(output_dir=job["output_dir"], max_steps=job["steps"],
                per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS, num_generations=NUM_GENERATIONS,
                max_completion_length=job["max_completion_length"], learning_rate=job["learning_rate"],
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                seed=job["seed"], bf16=job["precision"] == "bf16", use_cpu=True, disable_tqdm=True, beta=0.0,
                temperature=1.0, gradient_checkpointing=job["gradient_checkpointing"],
                scale_rewards="group")  # TRL's default advantage (r - mean) / std on both sides (AIPO's is r - mean)


class _Clock:
    """When training began, when each step ended, and the seconds spent in optimizer steps (`_callback`)."""

    def __init__(self):
        self.began, self.steps, self.optimizer, self._opt = None, [], 0.0, None


def _callback(clock: _Clock):
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.began = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            clock._opt = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            if clock._opt is not None:
                clock.optimizer += time.perf_counter() - clock._opt

        def on_step_end(self, args, state, control, **kw):
            clock.steps.append(time.perf_counter())

    return StepClock()


def _timed(obj, name: str, totals: dict, key: str) -> None:
    """Wrap `obj.name` so that its seconds add up in `totals[key]`."""
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


def bare_vllm(job: dict) -> None:
    """Child process: a bare `vllm.LLM.generate` of one batch (the same prompts, n, length and sampling as the
    generator), pinned to one core as the generator child is; the best of 3 after a warm-up."""
    from vllm import SamplingParams

    from hfllamarl.runtime.generation.engine import build_engine

    import torch

    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[-1]])
    torch.set_num_threads(1)
    dtype = "bfloat16" if job["precision"] == "bf16" else "float32"  # the generator's dtype under that precision
    llm = build_engine(job["model"], job["model"], dtype=dtype, seed=job["seed"], max_model_len=256,
                       tensor_parallel_size=1, distributed=False, use_cpu=True)
    tok = llm.get_tokenizer()
    rows = _dataset(job["seed"], job.get("preamble", "")).select(range(PROMPTS_PER_STEP))
    prompts = [{"prompt_token_ids": tok(r["prompt"])["input_ids"]} for r in rows]
    params = SamplingParams(n=NUM_GENERATIONS, max_tokens=job["max_completion_length"], temperature=1.0, logprobs=0,
                            seed=job["seed"])
    best = None
    for i in range(4):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if i and (best is None or tokens / seconds > best):
            best = tokens / seconds
    with open(job["result"], "w") as fh:
        json.dump({"tokens_per_s": best}, fh)


def run_side(job: dict) -> None:
    """Child process: one side, timed; writes its result to `job["result"]`."""
    import torch

    if job["side"] == "bare_vllm":
        return bare_vllm(job)

    clock, totals = _Clock(), {}
    if job["side"] == "trl":
        from trl import GRPOConfig, GRPOTrainer

        torch.set_num_threads(os.cpu_count() or 1)
        constructed = time.perf_counter()
        trainer = GRPOTrainer(model=job["model"], reward_funcs=digit_share,
                              train_dataset=_dataset(job["seed"], job.get("preamble", "")),
                              args=GRPOConfig(**_common(job), use_vllm=False), callbacks=[_callback(clock)])
        for name, key in (("_generate", "generation"), ("_calculate_rewards", "reward"),
                          ("_prepare_inputs", "prepare"), ("training_step", "training_step")):
            _timed(trainer, name, totals, key)
    else:
        from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer

        constructed = time.perf_counter()
        trainer = AsyncAIPOTrainer(model=job["model"], reward_funcs=digit_share,
                                   train_dataset=_dataset(job["seed"], job.get("preamble", "")),
                                   args=AsyncAIPOConfig(**{**_common(job), "max_staleness": 1,
                                                            **job.get("config", {})}),
                                   callbacks=[_callback(clock)])
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    init_seconds = start - constructed
    history = [h for h in trainer.state.log_history if "reward" in h]
    result = {"seconds": seconds, "init_seconds": init_seconds, "steps": len(clock.steps),
              "startup": getattr(trainer, "startup_profile", None) or {},
              "rewards": [h["reward"] for h in history],
              "first_step_after": clock.steps[0] - start if clock.steps else None,
              "step_seconds": [b - a for a, b in zip(clock.steps, clock.steps[1:])],
              "optimizer": clock.optimizer, "totals": totals, "history": history}
    with open(job["result"], "w") as fh:
        json.dump(result, fh)


def _profile_rows(side: str, r: dict) -> dict[str, float]:
    """Seconds per step by phase (steady state: the first step, which carries start-up, left out where per-step
    figures exist)."""
    n = max(r["steps"], 1)
    if side == "trl":
        t = r["totals"]
        gen, reward, prepare = t.get("generation", 0.0) / n, t.get("reward", 0.0) / n, t.get("prepare", 0.0) / n
        fwd_bwd = (t.get("training_step", 0.0) - t.get("prepare", 0.0)) / n
        step = r["seconds"] / n
        return {"generation": gen, "reward": reward, "other scoring (log-probs, advantages)": prepare - gen - reward,
                "forward + backward": fwd_bwd, "optimizer": r["optimizer"] / n,
                "rest": step - prepare - fwd_bwd - r["optimizer"] / n, "step (wall)": step}
    h = r["history"][1:] or r["history"]

    def mean(key):
        vals = [x.get(key, 0.0) for x in h]
        return sum(vals) / max(len(vals), 1)

    steady = r["step_seconds"][1:] or r["step_seconds"] or [r["seconds"] / n]
    step = sum(steady) / len(steady)
    rows = {"generation (generator core)": mean("generation/seconds"), "reward": mean("reward_seconds"),
            "forward + backward": mean("time/forward_backward"), "optimizer": mean("time/optimizer"),
            "weight sync (transfer)": mean("weight_sync_seconds"),
            "trainer waiting on channels": mean("time/channels"),
            # the trainer's head start: the first tokens of the generator's next batch, sampled while it waited
            "trainer's head start (sampling)": mean("time/head_start"),
            "  its tokens a completion": mean("head_start/tokens"), "step (wall)": step,
            "start-up before step 1": r["first_step_after"] or 0.0,
            # rows with advantage 0: run forward only (the default) or skipped (skip_flat_rows), share of the rows
            "flat groups, share": mean("frac_reward_zero_std"),
            "rows run forward only, share": mean("trainer/flat_rows_forward_only_frac"),
            "rows skipped, share": mean("trainer/flat_rows_skipped_frac")}
    rows.update(_work_rows([x for x in h if x.get("generation/cpu_seconds", 0.0) > 0]))
    s = r.get("startup") or {}  # milestones, seconds after train() (`hfllamarl.runtime.world.startup`)
    for key, label in (("generator_started", "generator process began"), ("generator_imported", "generator imports done"),
                       ("generator_engine", "generator engine built"), ("generator_ready", "generator ready"),
                       ("trainer_ready", "trainer ready"), ("trainer_first_rollouts", "first rollouts arrived"),
                       ("trainer_first_step", "first step ended"), ("trainer_handover", "generators took over")):
        if key in s:
            rows[f"  at {label}"] = s[key]
    if s.get("bootstrapped_batches"):  # sampled by the trainer itself while the generator started
        rows["  batches the trainer sampled itself"] = s["bootstrapped_batches"]
        rows["  of which it trained itself"] = s.get("bootstrap_trained_batches", s["bootstrapped_batches"])
    return rows


def _work_rows(h: list[dict]) -> dict[str, float]:
    """The steps after the generators took over, in core-seconds measured in the same run (each process's CPU time,
    every thread, over the step: `generation/cpu_seconds`, `time/cpu_seconds`): the work, the bound a step cannot
    beat on these cores (the work spread over all of them), and how far the step is from it. Also the bound of this
    design: the busiest generator process's own work (`generation/busiest_cpu_seconds`), which no core lent to it
    shortens (a vLLM engine on a CPU runs on the threads it was built with), and the step against the larger of the
    two."""
    if not h:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def mean(key):
        return sum(x.get(key, 0.0) for x in h) / len(h)

    gen, train, wall = mean("generation/cpu_seconds"), mean("time/cpu_seconds"), mean("step_time")
    bound = (gen + train) / cores
    busiest = mean("generation/busiest_cpu_seconds")
    serial = max(bound, busiest)
    return {"work: generator processes, core-s": gen, "work: trainer, core-s": train,
            f"bound: work / {cores} cores": bound, "step (wall) / bound": wall / bound if bound else 0.0,
            "cores idle, share of the step": 1.0 - bound / wall if wall else 0.0,
            "work: busiest generator process, core-s": busiest,
            "step (wall) / larger bound": wall / serial if serial else 0.0}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "an unnamed CPU"


def bench_model(output_dir: str, hidden_size: int, layers: int, seed: int) -> str:
    """The bench's model in `output_dir` (built once): a random-init Llama, head size 64, SwiGLU width 8/3."""
    from hfllamarl.testing.tiny import build_tiny_model

    os.makedirs(output_dir, exist_ok=True)
    model = os.path.join(output_dir, f"llama-{hidden_size}x{layers}")
    if not os.path.isfile(os.path.join(model, "config.json")):
        build_tiny_model(model, hidden_size=hidden_size, num_layers=layers, num_heads=hidden_size // 64,
                         intermediate_size=int(hidden_size * 8 / 3) // 64 * 64, max_position_embeddings=256, seed=seed)
    return model


def run(args) -> int:
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - {"trl", "hfllamarl"}:
        raise SystemExit(f"--sides {args.sides!r}: choose from trl, hfllamarl")
    variants = _variants(args.variant)
    if args.steps < 2 or args.hidden_size % 64 or args.layers < 1 or args.max_completion_length < 1:
        raise SystemExit("give --steps >= 2, --hidden-size a multiple of 64 (head size 64), --layers >= 1, "
                         "--max-completion-length >= 1")
    if not 0 <= args.prompt_tokens <= 256 - 4 - args.max_completion_length:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: give 0 to {256 - 4 - args.max_completion_length} "
                         "(the bench model has 256 positions for the prompt and the completion)")
    from hfllamarl.runtime.generation.preflight import cpu_has_bf16

    if args.precision == "auto":
        args.precision = "bf16" if cpu_has_bf16() else "fp32"
    elif args.precision == "bf16" and not cpu_has_bf16():
        raise SystemExit("--precision bf16: this CPU has no bf16 instructions (avx512_bf16 or AMX), so vLLM cannot "
                         "run a bf16 generator on it; use --precision fp32")
    model = bench_model(args.output_dir, args.hidden_size, args.layers, args.seed)
    with open(os.path.join(model, "config.json")) as fh:
        cfg = json.load(fh)
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    params = L * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h
    seeds = [args.seed] if args.seeds is None else [int(x) for x in args.seeds.split(",") if x.strip()]
    if not seeds:
        raise SystemExit(f"--seeds {args.seeds!r}: give comma-separated whole numbers")
    by_seed, server = {}, None
    if args.preloaded and "hfllamarl" in sides:
        from hfllamarl.runtime.world import preload

        server = preload.start_server(wait=False)  # it imports while the TRL side runs
    for seed in seeds:
        by_seed[seed] = {}
        for name in sides + list(variants) + (["bare_vllm"] if args.bare_vllm and seed == seeds[0] else []):
            side = "hfllamarl" if name in variants else name
            tag = name if len(seeds) == 1 else f"{name}-seed{seed}"
            job = {"side": side, "config": variants.get(name, {}), "model": model, "steps": args.steps, "seed": seed,
                   "max_completion_length": args.max_completion_length, "learning_rate": args.learning_rate,
                   "preamble": preamble(args.prompt_tokens),
                   "precision": args.precision, "gradient_checkpointing": args.gradient_checkpointing,
                   "output_dir": os.path.join(args.output_dir, tag), "result": os.path.join(args.output_dir, f"{tag}.json")}
            print(f"running {name}" + (f", seed {seed}" if len(seeds) > 1 else "") + " ...", flush=True)
            if side == "hfllamarl" and server is not None:
                preload.wait_ready(*server, timeout=600)
                os.environ[preload.ENV_PRELOAD] = server[1].path
            try:
                by_seed[seed][name] = run_job("hfllamarl.commands.bench_vs_trl", job, name)
            finally:
                os.environ.pop("HFLLAMARL_PRELOAD", None)
    if server is not None:
        server[0].terminate()
        server[0].wait(timeout=30)
    results = by_seed[seeds[0]]
    bare = results.pop("bare_vllm", None)
    quarter = max(args.steps // 4, 1)

    width = max(12, *(len(side) + 2 for side in results))

    def final(r):
        return sum(r["rewards"][-quarter:]) / max(len(r["rewards"][-quarter:]), 1)

    def mean_over_seeds(side, key):
        values = [key(by_seed[seed][side]) for seed in seeds]
        return sum(values) / len(values)

    print(f"\n{params / 1e6:.1f}M-parameter Llama, {args.steps} steps of {PROMPTS_PER_STEP * NUM_GENERATIONS} "
          f"completions ({NUM_GENERATIONS} per prompt) of up to {args.max_completion_length} tokens, "
          + (f"prompts of {args.prompt_tokens + 4} tokens, " if args.prompt_tokens else "")
          + f"{args.precision}, {os.cpu_count()} cores of {_cpu_name()}"
          + ("; hfllamarl's generator forked from a warm preload server" if server is not None else "")
          + (f"; means over seeds {seeds}" if len(seeds) > 1 else ""))
    print(f"{'side':<{width}}{'train() s':>11}{'steps/s':>9}{'first step s':>14}{'final reward':>14}{'mean reward':>13}"
          f"{'init s':>9}"
          f"{'process s':>11}")
    summary = {}
    for side in results:
        seconds = mean_over_seeds(side, lambda r: r["seconds"])
        summary[side] = {"seconds": round(seconds, 2),
                         "steps_per_s": round(mean_over_seeds(side, lambda r: r["steps"]) / seconds, 4),
                         "first_step_s": round(mean_over_seeds(side, lambda r: r["first_step_after"] or 0.0), 2),
                         "final_reward": round(mean_over_seeds(side, final), 4),
                         "mean_reward": round(mean_over_seeds(side, lambda r: sum(r["rewards"]) / max(len(r["rewards"]), 1)),
                                              4),
                         "init_seconds": round(mean_over_seeds(side, lambda r: r["init_seconds"]), 2),
                         "process_seconds": round(mean_over_seeds(side, lambda r: r["process_seconds"]), 2)}
        if len(seeds) > 1:
            summary[side]["final_reward_per_seed"] = {str(seed): round(final(by_seed[seed][side]), 4) for seed in seeds}
        s = summary[side]
        print(f"{side:<{width}}{s['seconds']:>11.1f}{s['steps_per_s']:>9.3f}{s['first_step_s']:>14.1f}"
              f"{s['final_reward']:>14.3f}{s['mean_reward']:>13.3f}{s['init_seconds']:>9.1f}{s['process_seconds']:>11.1f}")
    if len(seeds) > 1:
        print("final reward per seed: " + "; ".join(
            f"seed {seed}: " + ", ".join(f"{side} {final(by_seed[seed][side]):.3f}" for side in results)
            for seed in seeds))
    out = {**summary, "seeds": seeds, "steps": args.steps, "prompt_tokens": args.prompt_tokens,
           "precision": args.precision, "parameters": params, "cores": os.cpu_count(), "cpu": _cpu_name(),
           "preloaded": server is not None}
    for name in variants:  # each variant's train() time against TRL's
        if "trl" in summary:
            out[f"ratio_{name}"] = round(summary["trl"]["seconds"] / summary[name]["seconds"], 3)
            print(f"ratio (TRL train() time / {name} train() time): {out[f'ratio_{name}']:.2f}x")
    if "trl" in summary and "hfllamarl" in summary:
        # from the seconds the summary reports, so that the JSON agrees with itself (as bench multi-turn's ratios)
        trl, ours = summary["trl"], summary["hfllamarl"]
        out["ratio"] = round(trl["seconds"] / ours["seconds"], 3)
        out["ratio_init_and_train"] = round((trl["init_seconds"] + trl["seconds"])
                                            / (ours["init_seconds"] + ours["seconds"]), 3)
        out["ratio_process"] = round(trl["process_seconds"] / ours["process_seconds"], 3)
        out["final_reward_ratio"] = round(ours["final_reward"] / trl["final_reward"], 4) if trl["final_reward"] else None
        print(f"ratio (TRL train() time / hfllamarl train() time): {out['ratio']:.2f}x")
        print(f"  with the trainer's construction (init s + train() s): {out['ratio_init_and_train']:.2f}x; "
              f"whole processes (imports, data set, init, train(), exit): {out['ratio_process']:.2f}x")
    if len(seeds) > 1 and "trl" in summary:
        out.update(paired_against_trl(by_seed, seeds, [side for side in results if side != "trl"], final))
    if args.profile:
        for side, r in results.items():
            rows = _profile_rows(side, r)
            out[f"profile_{side}"] = {k: round(v, 3) for k, v in rows.items() if v is not None}
            print(f"\n{side}: seconds per step")
            for k, val in rows.items():
                if val is not None:
                    print(f"  {k:<40}{val:>8.2f}")
    if bare and "hfllamarl" in results:
        h = results["hfllamarl"]["history"][1:] or results["hfllamarl"]["history"]
        ours = sum(x["generation/tokens_per_s"] for x in h) / len(h)
        out["generator_tokens_per_s"], out["bare_vllm_tokens_per_s"] = round(ours, 1), round(bare["tokens_per_s"], 1)
        print(f"\ngenerator tokens/s {ours:.0f} vs bare vLLM LLM.generate on one core {bare['tokens_per_s']:.0f} "
              f"({100 * ours / bare['tokens_per_s']:.0f} %)")
    print(json.dumps(out))
    return 0


def paired_against_trl(by_seed: dict, seeds: list[int], sides: list[str], final) -> dict:
    """Each side against TRL seed by seed (the same model and data order), printed and returned: the mean reward over
    the run and the final reward as differences (side - TRL), the speed as TRL's train() seconds over the side's,
    each the mean over the seeds with its 95 % confidence interval (Student's t)."""
    from hfllamarl.study.stats import mean_ci

    out = {}
    for side in sides:
        mean = lambda r: sum(r["rewards"]) / max(len(r["rewards"]), 1)  # noqa: E731
        rows = {"mean_reward_diff": [mean(by_seed[s][side]) - mean(by_seed[s]["trl"]) for s in seeds],
                "final_reward_diff": [final(by_seed[s][side]) - final(by_seed[s]["trl"]) for s in seeds],
                "speed_ratio": [by_seed[s]["trl"]["seconds"] / by_seed[s][side]["seconds"] for s in seeds]}
        cells = {key: mean_ci(values) for key, values in rows.items()}
        for key, (m, half) in cells.items():
            out[f"{key}_{side}"] = {"mean": round(m, 4), "ci95": round(half, 4),
                                    "per_seed": [round(v, 4) for v in rows[key]]}
        (md, mh), (fd, fh), (sr, sh) = cells.values()
        print(f"{side} against TRL, seed by seed ({len(seeds)} seeds, mean and 95 % interval): mean reward "
              f"{md:+.4f} +- {mh:.4f}, final reward {fd:+.4f} +- {fh:.4f}, TRL's time / {side}'s {sr:.2f}x +- {sh:.2f}")
    return out


if __name__ == "__main__":
    run_side(json.loads(sys.argv[1]))
