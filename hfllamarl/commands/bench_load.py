"""`hfllamarl bench load`: what loading the policy costs each trainer rank, sharded vs whole, side by side.

    hfllamarl bench load [--params 3e8] [--trainers 2] [--modes sharded,whole]

Writes a random Llama of about `--params` parameters to a temporary directory (safetensors, fp32),
then, for each mode, starts `--trainers` trainer ranks (gloo) that load it and shard it with FSDP2 (with
`--trainer-tp t`: tensor parallel t x FSDP2, as `trainer_tensor_parallel_size`):

- `sharded`: hfllamarl's loader (`hfllamarl.runtime.weights.loading`): built on the meta device, sharded, each rank
  reading only its rows from the files;
- `whole`: `from_pretrained` on every rank, then sharding (what most trainers do).

Each rank samples its resident memory (every 2 ms) from just before loading to the end of sharding and
reports the peak growth over the model's fp32 bytes. Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def add_arguments(parser) -> None:
    parser.add_argument("--params", type=float, default=3e8, help="model size in parameters (default 3e8)")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--trainer-tp", type=int, default=1, help="trainer tensor-parallel size (the trainer ranks as "
                        "FSDP2 x tensor parallelism, as trainer_tensor_parallel_size)")
    parser.add_argument("--modes", default="sharded,whole", help="comma-separated: sharded, whole")
    parser.add_argument("--timeout", type=float, default=1800)


def _worker(opts: dict) -> None:
    import torch
    import torch.distributed as dist

    from hfllamarl.commands.bench_rank import RssPeak
    from hfllamarl.runtime.weights.fsdp import shard_model
    from hfllamarl.runtime.world.topology import settle_collectives_at_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    settle_collectives_at_exit()
    path, mode = opts["path"], opts["mode"]
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    import gc

    gc.collect()
    start = time.perf_counter()
    with RssPeak() as mem:
        if mode == "sharded":
            from hfllamarl.runtime.weights.loading import build_empty, load_shards, materialize

            model = build_empty(config, torch.float32)
            shard_model(model, "cpu", tp=opts.get("tp", 1))
            materialize(model, torch.device("cpu"))
            load_shards(model, path)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            shard_model(model, "cpu", tp=opts.get("tp", 1))
        gc.collect()
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    # A check that the rows are the right ones: every rank sums its share (a part several ranks hold, once);
    # rank 0 compares with the file.
    from hfllamarl.runtime.weights.fsdp import local_box

    checksum = torch.tensor([sum(float(local_box(p, dist.get_rank())[0].detach().double().sum())
                                 for p in model.parameters())], dtype=torch.float64)
    dist.all_reduce(checksum)
    result = {"rank": dist.get_rank(), "mode": mode, "peak_growth": mem.peak - mem.start,
              "final_growth": _rss() - mem.start, "local_bytes": local, "seconds": seconds,
              "checksum": float(checksum.item())}
    print("LOAD_RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _write_model(params: float, directory: str) -> tuple[int, int, float]:
    """A random Llama of about `params` parameters saved to `directory`; returns (parameters, fp32 bytes, sum)."""
    import torch
    from transformers import LlamaForCausalLM

    from hfllamarl.commands.bench_rank import llama_config_for

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config_for(params))
    model.save_pretrained(directory)
    n = sum(p.numel() for p in model.parameters())
    total = sum(float(p.double().sum()) for p in model.parameters())
    return n, n * 4, total


def _launch(opts: dict, world: int, timeout: float) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "hfllamarl.commands.bench_load", "--worker", json.dumps(opts)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise SystemExit(f"bench load: a trainer rank failed (exit code {p.returncode})")
            results += [json.loads(line[len("LOAD_RESULT "):]) for line in out.splitlines()
                        if line.startswith("LOAD_RESULT ")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(results, key=lambda r: r["rank"])


def run(args) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("sharded", "whole")]
    if bad or args.trainers < 1:
        raise SystemExit(f"--modes takes sharded and/or whole (got {bad}); --trainers must be >= 1")
    if args.trainer_tp < 1 or args.trainers % args.trainer_tp:
        raise SystemExit(f"--trainer-tp {args.trainer_tp} must divide --trainers {args.trainers}")
    directory = tempfile.mkdtemp(prefix="hfllamarl-bench-load-")
    try:
        params, model_bytes, total = _write_model(args.params, directory)
        summary = {"params": params, "model_bytes": model_bytes, "trainer_ranks": args.trainers,
                   "trainer_tp": args.trainer_tp}
        layout = (f"tensor parallel {args.trainer_tp} x FSDP2 {args.trainers // args.trainer_tp}"
                  if args.trainer_tp > 1 else "FSDP2")
        print(f"loading a {params / 1e6:.0f}M-parameter Llama ({model_bytes / 2**20:.0f} MiB fp32) on "
              f"{args.trainers} trainer rank(s), sharded with {layout}")
        print(f"{'mode':<10}{'rank':>5}{'peak growth MiB':>17}{'x model':>9}{'shard MiB':>11}{'seconds':>9}")
        for mode in modes:
            ranks = _launch({"path": directory, "mode": mode, "tp": args.trainer_tp}, args.trainers, args.timeout)
            for r in ranks:
                print(f"{mode:<10}{r['rank']:>5}{r['peak_growth'] / 2**20:>17.0f}{r['peak_growth'] / model_bytes:>9.2f}"
                      f"{r['local_bytes'] / 2**20:>11.0f}{r['seconds']:>9.1f}")
            summary[f"{mode}_peak_over_model"] = round(max(r["peak_growth"] for r in ranks) / model_bytes, 3)
            summary[f"{mode}_seconds"] = round(max(r["seconds"] for r in ranks), 2)
            summary[f"{mode}_weights_match"] = abs(ranks[0]["checksum"] - total) <= 1e-6 * max(1.0, abs(total))
        if "sharded" in modes and "whole" in modes:
            summary["whole_over_sharded"] = round(summary["whole_peak_over_model"] / summary["sharded_peak_over_model"], 2)
            print(f"peak growth per rank: sharded {summary['sharded_peak_over_model']:.2f}x the model, whole "
                  f"{summary['whole_peak_over_model']:.2f}x ({summary['whole_over_sharded']:.2f}x more)")
        print(json.dumps(summary))
        return 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
    else:
        import argparse

        parser = argparse.ArgumentParser(prog="hfllamarl bench load")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
