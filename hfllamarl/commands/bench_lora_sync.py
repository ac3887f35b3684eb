"""`hfllamarl bench lora-sync`: LoRA's two weight syncs side by side in one run, the adapters alone against the
adapted layers merged.

    hfllamarl bench lora-sync [--rank 16] [--steps 8] [--hidden-size 512] [--layers 6] [--precision auto|bf16|fp32]
                              [--verify] [--output-dir DIR]

Trains the vs-TRL bench's model (a random-init Llama, 18M parameters by default) with LoRA of rank `--rank` on every
linear layer (`target_modules="all-linear"`), once with `lora_sync="adapter"` and once with `lora_sync="merged"`,
each in a fresh process of its own, the same seed, data, reward and settings (`max_staleness=1`, 16 completions of
up to 48 tokens a step). For each it prints, per sync: the bytes sent (`weight_sync/bytes`), the transfer's seconds
on the trainer side (`weight_sync_seconds`) and the generator's load into its engine (`weight_sync/load_seconds`:
vLLM's `reload_weights` of the merged layers, or writing and registering the adapter), medians over the steps after
the first two; the generation batch's seconds (median: applying the adapters unmerged costs the engine compute per
token, which merged weights do not); then the ratios merged / adapter, the whole `train()` times, and the final
rewards. With `--verify`
both runs check every sync (`verify_weight_sync`: the adapted engine's log-probs against vLLM's own loader of the
merged layers; the merged engine bitwise against it), and their load times include that check.
The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import time

MODES = ("adapter", "merged")


def add_arguments(parser) -> None:
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r (lora_alpha = 2r), every linear layer")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each run")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="bf16 mixed precision and a bf16 generator, or fp32; auto: bf16 where the CPU has bf16 "
                             "instructions")
    parser.add_argument("--verify", action="store_true", help="verify_weight_sync in both runs")
    parser.add_argument("--output-dir", default="outputs/bench_lora_sync")


def run_side(job: dict) -> None:
    """Child process: one run, its step logs written to `job["result"]`."""
    from peft import LoraConfig

    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
    from hfllamarl.commands.bench_vs_trl import _dataset, digit_share

    config = AsyncAIPOConfig(output_dir=job["output_dir"], max_steps=job["steps"], per_device_train_batch_size=16,
                             num_generations=4, max_completion_length=48, learning_rate=1e-3, logging_steps=1,
                             save_strategy="no", report_to="none", seed=0, bf16=job["precision"] == "bf16",
                             use_cpu=True, disable_tqdm=True, max_staleness=1, lora_sync=job["mode"],
                             verify_weight_sync=job["verify"])
    peft_config = LoraConfig(r=job["rank"], lora_alpha=2 * job["rank"], lora_dropout=0.0,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = AsyncAIPOTrainer(model=job["model"], reward_funcs=digit_share, args=config, peft_config=peft_config,
                               train_dataset=_dataset(0))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    history = [h for h in trainer.state.log_history if "reward" in h]
    with open(job["result"], "w") as fh:
        json.dump({"seconds": seconds, "sync": trainer.lora_sync, "history": history}, fh)


def _median(history: list[dict], key: str) -> float:
    values = [h[key] for h in history[2:] if h.get("weight_sync/bytes")] or [h.get(key, 0.0) for h in history]
    return statistics.median(values) if values else 0.0


def run(args) -> int:
    from hfllamarl.commands.bench_vs_trl import bench_model, run_job
    from hfllamarl.runtime.generation.preflight import cpu_has_bf16

    if args.steps < 4:
        raise SystemExit("--steps: give at least 4 (the first two steps' syncs are left out of the medians)")
    if args.precision == "auto":
        args.precision = "bf16" if cpu_has_bf16() else "fp32"
    model = bench_model(args.output_dir, args.hidden_size, args.layers, 0)
    results = {}
    for mode in MODES:
        job = {"mode": mode, "model": model, "steps": args.steps, "rank": args.rank, "precision": args.precision,
               "verify": args.verify, "output_dir": os.path.join(args.output_dir, mode),
               "result": os.path.join(args.output_dir, f"{mode}.json")}
        print(f"running lora_sync={mode} ...", flush=True)
        results[mode] = run_job("hfllamarl.commands.bench_lora_sync", job, f"lora_sync={mode}")
        if results[mode]["sync"] != mode:
            raise SystemExit(f"lora_sync={mode} ran as {results[mode]['sync']!r}")
    rows = {}
    for mode, r in results.items():
        h = r["history"]
        rows[mode] = {"bytes": _median(h, "weight_sync/bytes"), "transfer_s": _median(h, "weight_sync_seconds"),
                      "load_s": _median(h, "weight_sync/load_seconds"),
                      "generation_s": statistics.median(x["generation/seconds"] for x in h[2:] or h),
                      "train_s": r["seconds"],
                      "final_reward": statistics.mean(x["reward"] for x in h[-max(len(h) // 4, 1):])}
    a, m = rows["adapter"], rows["merged"]
    print(f"\nLoRA r={args.rank}, all linear layers, {args.hidden_size}x{args.layers} Llama, {args.precision}, "
          f"{args.steps} steps{', verify_weight_sync' if args.verify else ''}")
    print(f"{'':>10} {'bytes/sync':>12} {'transfer s':>11} {'load s':>9} {'generation s':>13} {'train() s':>10} "
          f"{'final reward':>13}")
    for mode, row in rows.items():
        print(f"{mode:>10} {row['bytes']:>12.0f} {row['transfer_s']:>11.4f} {row['load_s']:>9.4f} "
              f"{row['generation_s']:>13.3f} {row['train_s']:>10.1f} {row['final_reward']:>13.3f}")

    def ratio(key):
        return m[key] / a[key] if a[key] > 0 else float("inf")

    ratios = {k: ratio(k) for k in ("bytes", "transfer_s", "load_s", "generation_s", "train_s")}
    print("merged / adapter: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(json.dumps({"rank": args.rank, "precision": args.precision, "steps": args.steps, "verify": args.verify,
                      "rows": rows, "merged_over_adapter": ratios}))
    return 0


if __name__ == "__main__":
    import sys

    run_side(json.loads(sys.argv[1]))
