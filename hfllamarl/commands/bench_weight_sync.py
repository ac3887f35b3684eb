"""`hfllamarl bench weight-sync`: the weight-sync backends timed side by side in one run.

    hfllamarl bench weight-sync [--params 1.1e8] [--trainers 2] [--generators 1] [--repeats 3]
    hfllamarl bench weight-sync --replicas 1,2 [--generators M] [--repeats 9]

With `--replicas`, `--generators` is the size of one vLLM replica (its tensor parallelism) and the job holds
max(replicas) of them: `nccl_ddma` is timed to the first R replicas for each R, the R interleaved repeat by repeat
(a shared machine's load falls alike on each), with the CPU seconds every rank spent, beside the bound (the
model as one message from one trainer rank to each rank of one replica).

Starts `trainers + generators` processes on this machine (gloo on loopback; NCCL is the same code
on GPUs), builds a Llama of about `--params` parameters on the trainer ranks, shards it with FSDP2,
and times one full weight sync with each backend, plus the transport's bound: the model's bytes sent
as one message from one trainer rank to every generator rank at once (one link per generator). It checks that every backend delivers the trainer's weights
bitwise, reports peak memory per rank, prints a table, and as its last line one JSON object.
The time is until the whole weight set is in the generator's memory (vLLM's own loading, the
same for every backend, is not included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

BACKENDS = ("nccl_ddma", "broadcast", "disk")


def add_weight_sync_arguments(parser) -> None:
    parser.add_argument("--params", type=float, default=1.1e8, help="model size in parameters (default 1.1e8)")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--generators", type=int, default=1)
    parser.add_argument("--trainer-tp", type=int, default=1, help="trainer tensor-parallel size: the trainer ranks as "
                        "a (trainers / this) x this mesh, FSDP2 x tensor parallelism, as trainer_tensor_parallel_size")
    parser.add_argument("--trainer-shard", type=int, default=None, help="FSDP2 shard groups of this many "
                        "data-parallel trainer ranks, replicated across the groups (hybrid sharding, as "
                        "trainer_fsdp_shard_size); default: every data-parallel rank")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per backend (the median is kept)")
    parser.add_argument("--bucket-mb", type=int, default=32, help="nccl_ddma bucket size in MiB")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--replicas", default=None, help="comma-separated replica counts, e.g. 1,2: nccl_ddma to each "
                        "(--generators is then the ranks of one replica)")
    parser.add_argument("--fan-out", type=int, default=None, help="with --replicas: nccl_ddma's fan_out (replicas the "
                        "trainer ranks feed directly; default max(1, trainers // --generators); --fan-out R: all)")
    parser.add_argument("--link-gbps", type=float, default=None, help="give every rank a link of this many Gbit/s each "
                        "way (paced transfers), so that the time shows how the bytes are routed instead of how busy "
                        "this machine's cores are")


def launch(opts: dict, world: int, timeout: float) -> dict:
    """Start `world` bench workers (rank 0 hosts the store) and return rank 0's gathered results."""
    from hfllamarl.runtime.world.ports import free_port

    port = free_port()  # (below the ephemeral range: a released kernel-chosen port can be taken before rank 0 binds it)
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "hfllamarl.commands.bench_rank", json.dumps(opts)], env=env,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True))
    try:
        out, _ = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise SystemExit(f"bench worker rank(s) {bad} failed (exit codes {[procs[i].returncode for i in bad]})")
    line = [l for l in out.splitlines() if l.startswith("BENCH_RESULT ")][-1]
    return json.loads(line[len("BENCH_RESULT "):])


def summarize(ranks: list[dict], opts: dict) -> dict:
    trainer0 = ranks[0]
    gens = [r for r in ranks if r["role"] == "generator"]
    seconds = {b: max(g[b]["seconds"] for g in gens) for b in opts["backends"]}
    bitwise = all(g[b]["digest"] == trainer0[f"expected/{b}"][i] for i, g in enumerate(gens) for b in opts["backends"])
    summary = {
        "params": trainer0["params"],
        "bytes": trainer0["bytes"],
        "trainer_ranks": opts["trainers"],
        "generator_ranks": opts["generators"],
        "ddma_s": round(seconds["nccl_ddma"], 4),
        "broadcast_s": round(seconds["broadcast"], 4),
        "disk_s": round(seconds["disk"], 4),
        "bound_s": round(max(g["bound_s"] for g in gens), 4),
        "bitwise_equal": bitwise,
        "trainer_tp": opts.get("trainer_tp", 1),
        "trainer_shard": opts.get("trainer_shard"),
        "ddma_sent_bytes": [r["nccl_ddma"]["sent_bytes"] for r in ranks if r["role"] == "trainer"],
    }
    for b, key in (("nccl_ddma", "ddma"), ("broadcast", "broadcast"), ("disk", "disk")):
        summary[f"{key}_peak_rss_mb"] = round(trainer0[b]["peak_rss_mb"], 1)
        summary[f"{key}_rank0_growth_mb"] = round(trainer0[b]["growth_mb"], 1)
        summary[f"{key}_generator_peak_rss_mb"] = round(max(g[b]["peak_rss_mb"] for g in gens), 1)
    summary["broadcast_over_ddma"] = round(summary["broadcast_s"] / summary["ddma_s"], 3)
    summary["ddma_over_bound"] = round(summary["ddma_s"] / summary["bound_s"], 3)
    return summary


def summarize_replicas(ranks: list[dict], opts: dict) -> dict:
    """Per replica count R: the median over repeats of the slowest participating rank, the CPU seconds of every rank
    added up, and whether every generator rank received exactly its part."""
    trainer0, tp = ranks[0], opts["tp"]
    gens = [r for r in ranks if r["role"] == "generator"]
    out = {"params": trainer0["params"], "bytes": trainer0["bytes"], "trainer_ranks": opts["trainers"],
           "replica_ranks": tp, "bound_s": round(max(g["bound_s"] for g in gens[:tp]), 4), "replicas": {}}
    for count in opts["replicas"]:
        key = f"replicas/{count}"
        taking_part = [r for r in ranks if r["role"] == "trainer" or ranks.index(r) < opts["trainers"] + count * tp]
        per_repeat = [max(r[key]["seconds"][i] for r in taking_part) for i in range(opts["repeats"])]
        cpu = [sum(r[key]["cpu"][i] for r in ranks) for i in range(opts["repeats"])]
        receivers = [r for r in gens if ranks.index(r) < opts["trainers"] + count * tp]
        bitwise = all(g[key]["digest"] == trainer0["expected/nccl_ddma"][gens.index(g)] for g in receivers)
        out["replicas"][str(count)] = {"seconds": round(sorted(per_repeat)[len(per_repeat) // 2], 4),
                                       "cpu_seconds": round(sorted(cpu)[len(cpu) // 2], 4), "bitwise_equal": bitwise}
    first = out["replicas"][str(opts["replicas"][0])]["seconds"]
    for count, entry in out["replicas"].items():
        entry["over_first"] = round(entry["seconds"] / first, 3)
        entry["over_bound"] = round(entry["seconds"] / out["bound_s"], 3)
    return out


def run_replicas(args) -> int:
    counts = sorted({int(c) for c in args.replicas.split(",")})
    if not counts or counts[0] < 1:
        raise SystemExit("--replicas takes replica counts >= 1, e.g. 1,2")
    opts = {"params": args.params, "trainers": args.trainers, "generators": counts[-1] * args.generators,
            "tp": args.generators, "replicas": counts, "repeats": args.repeats, "bucket_mb": args.bucket_mb,
            "backends": ["nccl_ddma"], "fan_out": args.fan_out, "link_gbps": args.link_gbps}
    summary = summarize_replicas(launch(opts, args.trainers + opts["generators"], args.timeout), opts)
    summary["fan_out"] = args.fan_out or max(1, args.trainers // args.generators)
    summary["link_gbps"] = args.link_gbps
    link = f", links of {args.link_gbps:g} Gbit/s" if args.link_gbps else ", loopback"
    print(f"nccl_ddma weight sync of {summary['params'] / 1e6:.1f}M parameters ({summary['bytes'] / 2**20:.0f} MiB "
          f"fp32), {args.trainers} trainer rank(s) -> R replicas of {args.generators} rank(s), fan_out "
          f"{summary['fan_out']}{link}, median of {args.repeats} (the R interleaved)")
    print(f"{'replicas':<10}{'seconds':>9}{'x R=' + str(counts[0]):>9}{'x bound':>9}{'CPU s (all ranks)':>19}"
          f"{'bitwise':>9}")
    for count, entry in summary["replicas"].items():
        print(f"{count:<10}{entry['seconds']:>9.3f}{entry['over_first']:>9.2f}{entry['over_bound']:>9.2f}"
              f"{entry['cpu_seconds']:>19.3f}{str(entry['bitwise_equal']):>9}")
    print(f"bound: {summary['bound_s']:.3f} s (the model as one message from one trainer rank to each rank of one "
          "replica)")
    print(json.dumps(summary))
    return 0


def run_weight_sync(args) -> int:
    opts = {"params": args.params, "trainers": args.trainers, "generators": args.generators,
            "repeats": args.repeats, "bucket_mb": args.bucket_mb, "backends": list(BACKENDS),
            "trainer_tp": args.trainer_tp, "trainer_shard": args.trainer_shard}
    if args.trainers < 1 or args.generators < 1:
        raise SystemExit("--trainers and --generators must be >= 1")
    if args.trainer_tp < 1 or args.trainers % args.trainer_tp:
        raise SystemExit(f"--trainer-tp {args.trainer_tp} must divide --trainers {args.trainers}")
    if args.trainer_shard and (args.trainers // args.trainer_tp) % args.trainer_shard:
        raise SystemExit(f"--trainer-shard {args.trainer_shard} must divide the {args.trainers // args.trainer_tp} "
                         "data-parallel trainer ranks")
    if args.replicas:
        return run_replicas(args)
    summary = summarize(launch(opts, args.trainers + args.generators, args.timeout), opts)
    model_mb = summary["bytes"] / 2**20
    from hfllamarl.runtime.world.mesh import describe

    layout = (f" ({describe(args.trainer_tp, args.trainers // args.trainer_tp, args.trainer_shard)})"
              if args.trainer_tp > 1 or args.trainer_shard else "")
    print(f"weight sync of {summary['params'] / 1e6:.1f}M parameters ({model_mb:.0f} MiB fp32), "
          f"{args.trainers} trainer rank(s){layout} -> {args.generators} generator rank(s), median of {args.repeats}")
    print(f"{'backend':<12}{'seconds':>10}{'GiB/s':>8}{'x bound':>9}{'rank-0 peak MiB':>17}{'rank-0 growth MiB':>19}")
    for key in ("ddma", "broadcast", "disk", "bound"):
        s = summary[f"{key}_s"]
        peak = summary.get(f"{key}_peak_rss_mb", float("nan"))
        growth = summary.get(f"{key}_rank0_growth_mb", float("nan"))
        print(f"{key:<12}{s:>10.3f}{summary['bytes'] / 2**30 / s:>8.2f}{s / summary['bound_s']:>9.2f}"
              f"{peak:>17.0f}{growth:>19.0f}")
    print(f"broadcast / ddma = {summary['broadcast_over_ddma']:.2f}x; ddma / bound = {summary['ddma_over_bound']:.2f}x;"
          f" bitwise equal: {summary['bitwise_equal']}")
    sent = summary["ddma_sent_bytes"]
    print(f"nccl_ddma bytes sent per trainer rank: {', '.join(f'{b / 2**20:.1f}' for b in sent)} MiB (the model: "
          f"{model_mb:.1f} MiB to each of {args.generators} generator rank(s) that reads all of it)")
    print(json.dumps(summary))
    return 0
