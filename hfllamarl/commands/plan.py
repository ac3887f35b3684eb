"""`hfllamarl plan`: split a GPU cluster between trainer and generator (LlamaRL section 6).

Compares a synchronous co-located run (all N GPUs train, then all generate) with an asynchronous split
(N_t trainer GPUs, N_g = N - N_t generator GPUs, each side with its own layout):

    sync  step = T_train(B, N) + T_gen(B, N, m)                 one tensor-parallel size for both phases
    async step = max(T_gen(B, N_g, m_g), T_train(B, N_t))        independent layouts

B, the global batch, counts completions: the sequences trained per optimizer step, B = prompts x group size
(TRL: generation_batch_size = prompts x num_generations); `--prompts-per-step` gives it in prompts instead.
The trainer is tp tensor shards x an FSDP (ZeRO-3) shard group, replicated across the rest of its GPUs; the
generator is a vLLM group of m_g = tp x pp GPUs. Every formula, constant and its source is in
`pydoc hfllamarl.commands.plan_model`. The search covers GPU counts, trainer tp and FSDP shard group, generator
model-parallel size, micro-batch and decode concurrency, under the per-GPU memory limit.

Sync: the trainer uses all N GPUs; the co-located generator's tensor-parallel size is the trainer's (a hybrid
engine gathers the FSDP shards into that layout), with pipeline stages across nodes when one copy does not fit
on a node. The trainer's weights shard, Adam state and master weights ((16 - 2) B/param over its shard group;
gradients are freed) stay resident while generating, unless --sync-offload moves Adam and master weights to the
host, paying 2 x 12 B/param over the shard group through PCIe per step.

--profile FILE (JSON) replaces the analytic curves by measurements (`hfllamarl bench profile` writes one):
  {"generation": [{"model_parallel": 1, "concurrency": 32, "seconds_per_step": 0.012}, ...],
   "training":   [{"model_parallel": 1, "seconds_per_token": 3.0e-5}, ...],
   "measured_on": {...}}
seconds_per_step: one decode step (a token for each of `concurrency` sequences) on one generator group of that
model-parallel size; seconds_per_token: wall time per trained token of one trainer tensor-parallel group of that
size (forward + backward (+ recompute) + optimizer step, FSDP traffic not included). Measured points are used
exactly; between points of one size the measured/analytic ratio is interpolated in concurrency (held beyond the
ends); sizes without measurements use the geometric mean of the ratios. "measured_on" (optional) describes the
machine and model and is not read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from hfllamarl.runtime.world.mesh import describe

from .plan_model import (Hardware, Model, PlanError, Profile, Workload, compute_time, decode_step,  # noqa: F401
                         fsdp_time, generator_memory, kv_per_seq, max_concurrency, microbatch_time, prefill_time,
                         step_fixed_time, tp_of, trainer_memory)

# Llama 3.x: parameters -> (layers, hidden, kv heads, head dim, vocab)
LLAMA_SHAPES = {1.24e9: (16, 2048, 8, 64, 128256), 3.21e9: (28, 3072, 8, 128, 128256),
                8.03e9: (32, 4096, 8, 128, 128256), 70.6e9: (80, 8192, 8, 128, 128256),
                405.9e9: (126, 16384, 8, 128, 128256)}


def parse_size(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*", str(text), re.I)
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"cannot parse model size {text!r}: use e.g. 8B, 1.5B, 500M or a parameter count")
    return float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}[m.group(2).upper()]


def parse_memory(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GB|G|GiB|TB|MB)?\s*", str(text), re.I)
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"cannot parse GPU memory {text!r}: use e.g. 80GB, 24GB or 96GiB")
    return float(m.group(1)) * {"GB": 1e9, "G": 1e9, "GIB": 2 ** 30, "TB": 1e12, "MB": 1e6}[
        (m.group(2) or "GB").upper()]


def model_from_size(params: float) -> Model:
    """Llama 3 shape within 25% of a Llama 3 size, else a Llama-like shape with depth ~ hidden / 128."""
    near = min(LLAMA_SHAPES, key=lambda p: abs(math.log(p / params)))
    if abs(math.log(near / params)) < math.log(1.25):
        return Model(params, *LLAMA_SHAPES[near], name=f"Llama-3-like {params / 1e9:.3g}B")
    hidden = max(128, round((params * 128 / 12) ** (1 / 3) / 128) * 128)
    layers = max(1, round(params / (12 * hidden * hidden)))
    return Model(params, layers, hidden, min(8, hidden // 128), 128, 128256, name=f"Llama-like {params / 1e9:.3g}B")


def model_from_config(path: str) -> Model:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"no config.json at {path}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{path} is not a JSON object")
    if cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts"):
        raise PlanError(f"{path}: mixture-of-experts models are not supported")
    need = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    missing = [k for k in need if not isinstance(cfg.get(k), int) or cfg[k] <= 0]
    if missing:
        raise PlanError(f"{path}: missing or invalid {', '.join(missing)} (a Llama-like config is needed)")
    h, n_layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv, d = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    bias = heads * d + 2 * kv * d if cfg.get("attention_bias") else 0
    layer = 2 * h * heads * d + 2 * h * kv * d + 3 * h * cfg["intermediate_size"] + 2 * h + bias
    params = n_layers * layer + cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    return Model(float(params), n_layers, h, kv, d, cfg["vocab_size"],
                 name=f"{cfg.get('model_type', 'model')} {params / 1e9:.3g}B")


def mp_candidates(n: int, hw: Hardware) -> list[int]:
    """Generator model-parallel sizes: 1, 2, 4 within a node, then whole nodes x 1, 2, 4, ..."""
    out = [m for m in (1, 2, 4, 8, 16, 32, 64) if m < hw.gpus_per_node and m <= n]
    m = hw.gpus_per_node
    while m <= n:
        out.append(m)
        m *= 2
    return out


def tp_candidates(hw: Hardware) -> list[int]:
    return [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= hw.gpus_per_node]


def shard_candidates(n: int, tp: int) -> list[int]:
    """Trainer groups m_t = tp x FSDP shards that divide n: tp x powers of two, and n itself (plain FSDP)."""
    out, m = [], tp
    while m <= n:
        if n % m == 0:
            out.append(m)
        m *= 2
    return out + ([n] if n % tp == 0 and n not in out else [])


# ---- time of each side -----------------------------------------------------------------------
def gen_time(model, wl, hw, prof, n, m, weight_bytes, resident=0.0):
    """(seconds, concurrency) to generate B completions on n GPUs in groups of m, or None if no fit."""
    c_max = max_concurrency(model, wl, hw, m, weight_bytes, resident)
    if c_max < 1 or n < m:
        return None
    seqs = math.ceil(wl.batch // wl.group / (n // m)) * wl.group
    waves = math.ceil(seqs / c_max)
    c = math.ceil(seqs / waves)
    step = decode_step(model, wl, hw, m, c, weight_bytes) * prof.gen_factor(m, c)
    return waves * (prefill_time(model, wl, hw, m, c) + wl.completion * step), c


def tokens_per_gpu(model, wl, hw, prof, m, c, weight_bytes) -> float:
    """Decode throughput per GPU of a group of m GPUs holding c sequences."""
    return c / (m * decode_step(model, wl, hw, m, c, weight_bytes) * prof.gen_factor(m, c))


def train_time(model, wl, hw, prof, n, m, tp):
    """(seconds, micro-batch, accumulation steps) to train B samples on n GPUs as n / m groups of m = tp x FSDP
    shards, or None if nothing fits."""
    if n % m or m % tp or tp > hw.gpus_per_node:
        return None
    per_group = math.ceil(wl.batch * tp / n)  # samples of each tensor-parallel group
    fsdp, fixed = fsdp_time(model, hw, m, tp), step_fixed_time(model, wl, hw, n, m)
    best, mb = None, 1
    while mb <= min(per_group, 64):
        if trainer_memory(model, wl, hw, m, tp, mb) <= hw.usable:
            k, rest = divmod(per_group, mb)  # k full micro-batches and a shorter last one
            t = k * microbatch_time(prof.compute_time(model, wl, hw, tp, mb), fsdp, model) + fixed
            if rest:
                k, t = k + 1, t + microbatch_time(prof.compute_time(model, wl, hw, tp, rest), fsdp, model)
            if best is None or t < best[0] * 0.999:
                best = (t, mb, k)
        mb *= 2
    return best


def best_trainer(model, wl, hw, prof, n):
    """((seconds, mb, k), m_t, tp) of the fastest trainer layout on n GPUs, or None."""
    best = None
    for tp in tp_candidates(hw):
        for m in shard_candidates(n, tp):
            t = train_time(model, wl, hw, prof, n, m, tp)
            if t and (best is None or t[0] < best[0][0] * 0.999):
                best = (t, m, tp)
    return best


# ---- search ----------------------------------------------------------------------------------
def plan(model: Model, wl: Workload, hw: Hardware, n: int, prof: Profile | None = None) -> dict:
    prof = prof or Profile()
    prof.calibrate(lambda m, c: decode_step(model, wl, hw, m, c, wl.gen_bytes),
                   lambda tp: compute_time(model, wl, hw, tp, 1) / wl.seq)
    mps = mp_candidates(n, hw)
    gen_best: dict[int, tuple] = {}  # GPUs -> ((seconds, c), m): T_train and T_gen are separable
    for m in mps:
        for size in range(m, n, m):
            g = gen_time(model, wl, hw, prof, size, m, wl.gen_bytes)
            if g and (size not in gen_best or g[0] < gen_best[size][0][0] * 0.999):
                gen_best[size] = (g, m)
    best = None
    for nt in range(1, n):
        if n - nt not in gen_best or not (tr := best_trainer(model, wl, hw, prof, nt)):
            continue
        (tt, mb, acc), mt, tp = tr
        (tg, c), mg = gen_best[n - nt]
        key = (round(max(tt, tg), 9), tt + tg)
        if best is None or key < best[0]:
            best = (key, dict(trainer_gpus=nt, generator_gpus=n - nt, trainer_mp=tp, trainer_fsdp=mt // tp,
                              generator_mp=mg, micro_batch=mb, grad_accum=acc, decode_concurrency=c,
                              train_s=tt, gen_s=tg, async_step_s=max(tt, tg)))
    if best is None:
        raise PlanError(not_fitting(model, wl, hw, n))
    out = best[1]
    out["trainer_mem_gb"] = trainer_memory(model, wl, hw, out["trainer_mp"] * out["trainer_fsdp"], out["trainer_mp"],
                                           out["micro_batch"]) / 1e9
    out["generator_mem_gb"] = generator_memory(model, wl, hw, out["generator_mp"], out["decode_concurrency"],
                                               wl.gen_bytes) / 1e9
    out["decode_tokens_per_gpu_s"] = tokens_per_gpu(model, wl, hw, prof, out["generator_mp"],
                                                    out["decode_concurrency"], wl.gen_bytes)
    out.update(sync_plan(model, wl, hw, prof, n, mps))
    if out["sync_mp"]:
        out["sync_decode_tokens_per_gpu_s"] = tokens_per_gpu(model, wl, hw, prof, out["sync_mp"],
                                                             out["sync_decode_concurrency"], 2)
    out["speedup"] = out["sync_step_s"] / out["async_step_s"] if out["sync_step_s"] else None
    out["launch"] = launch_settings(out, n, hw)
    return out


def launch_settings(o: dict, n: int, hw: Hardware) -> dict:
    """What to launch for the recommended split, as the runtime runs it: the launcher's processes per node (ranks
    fill node 0 first; the last `num_generator_processes` generate), `num_generator_processes` and
    `generator_tensor_parallel_size` (their ratio is the number of vLLM replicas), where each replica lands, and the
    trainer: `trainer_tensor_parallel_size` = the planned trainer tensor parallelism (with sequence parallelism),
    FSDP2 over the planned shard groups (`trainer_fsdp_shard_size` when they are fewer than the data-parallel
    ranks: hybrid sharding). The runtime runs the planned layout, so its predicted step is the plan's."""
    nt, ng, m, per = o["trainer_gpus"], o["generator_gpus"], o["generator_mp"], min(n, hw.gpus_per_node)
    nodes = -(-n // per)
    per_node = []
    for node in range(nodes):
        ranks = range(node * per, min((node + 1) * per, n))
        gens = [r for r in ranks if r >= nt]
        per_node.append({"node": node, "trainer_processes": len(ranks) - len(gens), "generator_processes": len(gens),
                         "replicas": sorted({(r - nt) // m for r in gens})})
    tp, fsdp = o["trainer_mp"], o["trainer_fsdp"]
    dp = nt // tp
    shard = fsdp if fsdp < dp else None
    fields = ([f"trainer_tensor_parallel_size={tp}", "trainer_sequence_parallel=True"] if tp > 1 else []) + (
        [f"trainer_fsdp_shard_size={shard}"] if shard else [])
    trainer = (f"{describe(tp, dp, shard)} ({', '.join(fields)})" if fields else
               f"FSDP2 over the {nt} trainer rank{'s' if nt > 1 else ''}")
    return {"nodes": nodes, "nproc_per_node": per, "num_processes": n, "uneven_nodes": n % per != 0,
            "num_generator_processes": ng, "generator_tensor_parallel_size": m, "replicas": ng // m,
            "replicas_across_nodes": [r for r in range(ng // m) if len({(nt + r * m + i) // per for i in range(m)}) > 1],
            "per_node": per_node,
            "trainer_tensor_parallel_size": tp, "trainer_fsdp_shard_size": shard, "trainer": trainer,
            "trainer_layout_as_planned": True,
            "runtime_train_s": round(o["train_s"], 3), "runtime_micro_batch": o["micro_batch"]}


def render_launch(launch: dict, o: dict) -> list[str]:
    """The launch block of `hfllamarl plan`'s output."""
    l = launch
    lines = [f"launch: {l['nodes']} node(s) x {l['nproc_per_node']} processes = {l['num_processes']}; "
             f"num_generator_processes={l['num_generator_processes']} generator_tensor_parallel_size="
             f"{l['generator_tensor_parallel_size']} ({l['replicas']} vLLM replica(s)); trainer: {l['trainer']}"]
    groups: list[list] = []  # consecutive nodes that hold the same processes
    for node in l["per_node"]:
        what = (node["trainer_processes"], node["generator_processes"], len(node["replicas"]))
        if groups and groups[-1][1] == what and groups[-1][0][-1] == node["node"] - 1:
            groups[-1][0].append(node["node"])
        else:
            groups.append([[node["node"]], what])
    for ids, (t, g, r) in groups:
        where = f"node {ids[0]}" if len(ids) == 1 else f"nodes {ids[0]}-{ids[-1]}"
        parts = ([f"{t} trainer"] if t else []) + ([f"{g} generator ({r} replica{'s' if r > 1 else ''})"] if g else [])
        lines.append(f"  {where}: {' + '.join(parts)} processes" + (" each" if len(ids) > 1 else ""))
    nodes = f"--nnodes {l['nodes']} --node_rank $NODE " if l["nodes"] > 1 else ""
    lines.append(f"  torchrun {nodes}--nproc_per_node {l['nproc_per_node']} examples/train_math.py --config RECIPE "
                 f"--num_generator_processes {l['num_generator_processes']} --generator_tensor_parallel_size "
                 f"{l['generator_tensor_parallel_size']}"
                 # (the plan's activation memory divides by tp: sequence parallelism inside each group)
                 + (f" --trainer_tensor_parallel_size {l['trainer_tensor_parallel_size']} --trainer_sequence_parallel "
                    "true" if l["trainer_tensor_parallel_size"] > 1 else "")
                 + (f" --trainer_fsdp_shard_size {l['trainer_fsdp_shard_size']}" if l["trainer_fsdp_shard_size"] else ""))
    if l["uneven_nodes"]:
        lines.append(f"  note: {l['num_processes']} processes do not fill nodes of {l['nproc_per_node']} evenly, and "
                     "torchrun and accelerate start the same number on every node")
    if l["replicas_across_nodes"]:
        lines.append(f"  note: replica(s) {l['replicas_across_nodes']} span two nodes (tensor parallelism across the "
                     "network); a split on node boundaries avoids it")
    return lines


def sync_plan(model, wl, hw, prof, n, mps) -> dict:
    best = dict.fromkeys(("sync_mp", "sync_trainer_mp", "sync_trainer_fsdp", "sync_micro_batch",
                          "sync_decode_concurrency", "sync_train_s", "sync_gen_s", "sync_step_s", "sync_mem_gb",
                          "sync_decode_tokens_per_gpu_s"))
    for g in (g for g in mps if n % g == 0):
        tp = tp_of(g, hw)
        for m in shard_candidates(n, tp):
            kept = (2 if wl.sync_offload else wl.state_bytes - 2) * model.params / m  # resident while generating
            t, gen = train_time(model, wl, hw, prof, n, m, tp), gen_time(model, wl, hw, prof, n, g, 2, kept)
            if not t or not gen:
                continue
            tg = gen[0] + (2 * (wl.state_bytes - 4) * model.params / m / hw.pcie if wl.sync_offload else 0.0)
            if best["sync_step_s"] is None or t[0] + tg < best["sync_step_s"] * 0.999:
                mem = max(trainer_memory(model, wl, hw, m, tp, t[1]),
                          generator_memory(model, wl, hw, g, gen[1], 2, kept))
                best = dict(sync_mp=g, sync_trainer_mp=tp, sync_trainer_fsdp=m // tp, sync_micro_batch=t[1],
                            sync_decode_concurrency=gen[1], sync_train_s=t[0], sync_gen_s=tg, sync_step_s=t[0] + tg,
                            sync_mem_gb=mem / 1e9)
    return best


def not_fitting(model, wl, hw, n) -> str:
    big = mp_candidates(1 << 20, hw)
    mt = next((m for m in big if trainer_memory(model, wl, hw, m, tp_of(m, hw), 1) <= hw.usable), None)
    mg = next((m for m in big if max_concurrency(model, wl, hw, m, wl.gen_bytes) >= 1), None)
    if mt is None or mg is None:
        return (f"one sequence of {wl.seq} tokens does not fit in {hw.memory / 1e9:.0f} GB GPUs at any model-parallel "
                f"size (activations or KV cache): shorten --prompt-length/--completion-length or use larger GPUs")
    msg = (f"{model.name} does not fit on {n} GPUs of {hw.memory / 1e9:.0f} GB: the trainer state alone is "
           f"{wl.state_bytes * model.params / 1e12:.2f} TB ({wl.state_bytes} B/param); it needs a trainer "
           f"shard group of >= {mt} GPUs plus a generator group of >= {mg} GPUs, i.e. >= {mt + mg} GPUs")
    fits = [max(trainer_memory(model, wl, hw, a, tp_of(a, hw), 1), generator_memory(model, wl, hw, b, 1, wl.gen_bytes))
            for a in mp_candidates(n, hw) for b in mp_candidates(n, hw) if a + b <= n]
    return msg + (f", or GPUs with >= {min(fits) / (1 - hw.headroom) / 1e9:.0f} GB each" if fits else "")


# ---- command line ----------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Recommend a trainer/generator GPU split from LlamaRL's memory and step-time model."
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-size", help="parameter count, e.g. 8B, 70B, 405B, 1.5B, 500M (Llama-3-like shape)")
    src.add_argument("--model-config", help="config.json (or its directory) of a Llama-like HF model")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs N")
    p.add_argument("--gpu-memory", default="80GB", help="memory per GPU (default 80GB)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, help="COMPLETIONS per optimizer step = prompts x --group-size "
                       "(TRL's generation_batch_size; default 2048)")
    batch.add_argument("--prompts-per-step", type=int, help="the global batch in PROMPTS instead: completions = "
                       "prompts x --group-size")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (TRL's num_generations)")
    p.add_argument("--prompt-length", type=int, default=1024)
    p.add_argument("--completion-length", type=int, default=2048)
    p.add_argument("--generator-precision", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--no-master-weights", action="store_true", help="no fp32 master copy: 12 B/param, not 16")
    p.add_argument("--sync-offload", action="store_true", help="sync baseline offloads optimizer state to host")
    p.add_argument("--gpu-flops", type=float, default=989e12, help="peak dense bf16 FLOP/s (H100 SXM)")
    p.add_argument("--hbm-bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM)")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--bandwidth-efficiency", type=float, default=0.8, help="achieved / peak HBM of decode kernels")
    p.add_argument("--memory-headroom", type=float, default=0.1, help="fraction of GPU memory kept free")
    p.add_argument("--profile", help="JSON of measured decode-step and training-token times (`pydoc hfllamarl.commands.plan`)")


def run(args) -> int:
    try:
        out, text = _run(args)
    except PlanError as e:
        print(f"hfllamarl plan: error: {e}", file=sys.stderr)
        return 2
    print(text)
    print(json.dumps(out))
    return 0


def _run(args):
    for name in ("gpus", "gpus_per_node", "global_batch", "prompts_per_step", "group_size", "prompt_length",
                 "completion_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompts_per_step:
        batch = args.prompts_per_step * args.group_size
    else:
        batch = args.global_batch or 2048
        if batch % args.group_size:
            raise PlanError(f"--global-batch {batch} (completions) is not a multiple of --group-size {args.group_size}")
    if not (0 < args.mfu <= 1 and 0 < args.bandwidth_efficiency <= 1 and 0 <= args.memory_headroom < 1):
        raise PlanError("--mfu and --bandwidth-efficiency must be in (0, 1], --memory-headroom in [0, 1)")
    if args.gpus < 2:
        raise PlanError("an asynchronous split needs --gpus >= 2 (one trainer and one generator GPU)")
    model = model_from_config(args.model_config) if args.model_config else model_from_size(parse_size(args.model_size))
    hw = Hardware(parse_memory(args.gpu_memory), args.gpus_per_node, args.gpu_flops, args.hbm_bandwidth, args.mfu,
                  args.bandwidth_efficiency, args.memory_headroom)
    wl = Workload(batch, args.group_size, args.prompt_length, args.completion_length,
                  not args.no_activation_checkpointing, not args.no_master_weights,
                  1 if args.generator_precision == "fp8" else 2, args.sync_offload)
    prof = None
    if args.profile:
        try:
            with open(args.profile) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"cannot read profile {args.profile}: {e}") from None
        if not isinstance(data, dict):
            raise PlanError(f"profile {args.profile} is not a JSON object")
        prof = Profile(data)
    out = {"model": model.name, "params": model.params, "gpus": args.gpus, "completions": batch,
           "prompts": batch // args.group_size, **plan(model, wl, hw, args.gpus, prof),
           "generator_precision": args.generator_precision, "profile": bool(args.profile)}
    out = {k: round(v, 3) if isinstance(v, float) and k != "params" else v for k, v in out.items()}
    return out, render(out, model, wl, hw)


def render(o: dict, model: Model, wl: Workload, hw: Hardware) -> str:
    def s(x, unit=""):
        return "does not fit" if x is None else f"{x:.1f}{unit}" if isinstance(x, float) else f"{x}{unit}"

    sync_fits = o["sync_mp"] is not None
    rows = [("", "asynchronous (split)", "synchronous (co-located)"),
            ("trainer / generator GPUs", f"{o['trainer_gpus']} / {o['generator_gpus']}", f"{o['gpus']} shared"),
            ("trainer tensor-parallel x FSDP shard", f"{o['trainer_mp']} x {o['trainer_fsdp']}",
             f"{o['sync_trainer_mp']} x {o['sync_trainer_fsdp']}" if sync_fits else s(None)),
            ("generator model-parallel", s(o["generator_mp"]), s(o["sync_mp"])),
            ("micro-batch (x grad accum)", f"{o['micro_batch']} (x{o['grad_accum']})", s(o["sync_micro_batch"])),
            ("decode concurrency per group", s(o["decode_concurrency"]), s(o["sync_decode_concurrency"])),
            ("decode tokens/s per GPU", f"{o['decode_tokens_per_gpu_s']:.0f}",
             s(None) if not sync_fits else f"{o['sync_decode_tokens_per_gpu_s']:.0f}"),
            ("memory/GPU trainer | generator", f"{o['trainer_mem_gb']:.1f} | {o['generator_mem_gb']:.1f} GB",
             s(o["sync_mem_gb"], " GB")),
            ("train time", s(o["train_s"], " s"), s(o["sync_train_s"], " s")),
            ("generation time", s(o["gen_s"], " s"), s(o["sync_gen_s"], " s")),
            ("step time", s(o["async_step_s"], " s"), s(o["sync_step_s"], " s"))]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    head = (f"{model.name}: {model.layers} layers, hidden {model.hidden}, {model.kv_heads} kv heads x "
            f"{model.head_dim}; {o['gpus']} GPUs x {hw.memory / 1e9:.0f} GB; batch {wl.batch} completions = "
            f"{wl.batch // wl.group} prompts x {wl.group}; {wl.prompt} + {wl.completion} tokens; generator "
            f"{o['generator_precision']}{'; measured profile' if o['profile'] else ''}")
    lines = [head] + [f"{a.ljust(w0)}  {b.ljust(w1)}  {c}" for a, b, c in rows]
    sp = o["speedup"]
    lines.append(f"predicted speed-up (sync / async): {sp:.2f}x" if sp else "predicted speed-up: sync does not fit")
    return "\n".join(lines + render_launch(o["launch"], o))
