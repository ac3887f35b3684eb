"""`hfllamarl plan`: split a GPU cluster between trainer and generator (LlamaRL section 6).

Compares a synchronous co-located run (all N GPUs train, then all generate, with one
model-parallel size m for both phases) with an asynchronous split (N_t trainer GPUs,
N_g = N - N_t generator GPUs, independent model-parallel sizes m_t and m_g):

    sync  step = T_gen(B, N, m) + T_train(B, N, m)
    async step = max(T_gen(B, N_g, m_g), T_train(B, N_t, m_t))

B completions per step, P parameters, L layers, h hidden, V vocab, kv x d key/value heads x
head dim, S = prompt + completion tokens, G group size. A model-parallel group of m GPUs is
tp = min(m, gpus per node) tensor shards x pp = m / tp pipeline stages (whole nodes);
m runs over 1, 2, 4 and then a node x 1, 2, 4, ...

Memory per GPU, must fit in (1 - headroom) x GPU memory (headroom 0.1: CUDA context, NCCL
buffers, fragmentation):
  trainer   = 16 B x P / m_t      bf16 weights 2 + bf16 grads 2 + fp32 Adam m, v 4 + 4 + fp32
                                  master 4 (12 B with --no-master-weights)
            + activations / tp    1F1B keeps pp micro-batches in flight, so pp does not divide them
    activations = mb x S x h x (2 L + 34) B with activation checkpointing (layer inputs kept, one
    layer recomputed; Korthikanti et al. 2022 with flash attention), 34 L without, + fp32 logits
    mb x S x V x 4 B.
  generator = w x P / m_g + c x KV_seq / m_g,  w = 2 (bf16) or 1 (fp8),
    KV_seq = 2 x L x kv x d x 2 B x S,  c = sequences decoded at once by one group.
  Sync: the generator uses the trainer's bf16 weights; Adam states and master weights (12 B/param)
  stay resident while generating (DeepSpeed-Chat-like hybrid engine), unless --sync-offload moves
  them to the host, paying 2 x 12 P / m bytes over PCIe per step.

Training time, compute bound. Each of the N_t / m_t replicas trains ceil(B m_t / N_t) samples as
k micro-batches of mb:
  T_train = (k + pp - 1) x (F + tp_comm + pp_hop) + 2 x 2 P / m_t / inter-node bandwidth (grad all-reduce)
  F = f P mb S / (m_t x peak x MFU x e),  f = 8 with checkpointing (6 + recompute) else 6,
      e = x / (x + 512) for x = mb S tokens (small GEMMs run below peak)
  tp_comm = (L / pp) x (6 or 4) all-reduces of mb S h x 2 B over NVLink (latency + ring volume).
Generation time, memory-bandwidth bound decode. A prompt's G samples stay on one of the N_g / m_g
groups; a group with n sequences decodes them in ceil(n / c_max) waves (c_max from the memory left
for KV), each wave = prefill (compute bound, prompt shared by its G samples) + completion x t_step:
  t_step = max((w P / tp + c x KV_avg / m_g) / (HBM x eff), 2 P c / (m_g x peak x MFU))
           + 2 L all-reduces of c h x 2 B (tp > 1) + (pp - 1) stage hops + 1 ms per-step overhead,
  KV_avg = KV at the mean context prompt + completion / 2. Pipeline stages hold P / m_g weights,
  but keeping every stage busy needs pp micro-batches, each reading the stage weights: w P / tp.
Defaults: H100-80GB SXM, 989 TFLOPS dense bf16, 3.35 TB/s HBM, MFU 0.4, decode bandwidth efficiency
0.6, NVLink 450 GB/s, 50 GB/s per GPU between nodes, all-reduce latency 10 us (30 us across nodes),
PCIe 25 GB/s. Weight sync (seconds with DDMA) and reward time are not modelled.

--profile FILE (JSON) replaces the analytic curves by measurements:
  {"generation": [{"model_parallel": 1, "concurrency": 32, "seconds_per_step": 0.012}, ...],
   "training":   [{"model_parallel": 2, "seconds_per_token": 3.0e-5}, ...]}
seconds_per_step: one decode step (a token for each of `concurrency` sequences) on one group of that
size; seconds_per_token: steady-state wall time of one trainer group of that size per trained token
(forward + backward + recompute). Measured points are used exactly; between points of one size the
measured/analytic ratio is interpolated in concurrency (held beyond the ends); sizes without
measurements use the geometric mean of the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass

KV_BYTES = 2  # bf16 KV cache
STEP_OVERHEAD_S = 1e-3  # per decode step: scheduling, sampling, kernel launches


class PlanError(ValueError):
    """Bad input: printed as one line, exit code 2."""


@dataclass
class Model:
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int
    name: str


@dataclass
class Hardware:
    memory: float
    gpus_per_node: int = 8
    flops: float = 989e12
    hbm: float = 3.35e12
    mfu: float = 0.4
    bw_eff: float = 0.6
    headroom: float = 0.1
    nvlink: float = 450e9
    inter: float = 50e9
    lat_intra: float = 10e-6
    lat_inter: float = 30e-6
    pcie: float = 25e9

    @property
    def usable(self) -> float:
        return self.memory * (1 - self.headroom)


@dataclass
class Workload:
    batch: int
    group: int
    prompt: int
    completion: int
    checkpointing: bool = True
    master: bool = True
    gen_bytes: int = 2
    sync_offload: bool = False

    @property
    def seq(self) -> int:
        return self.prompt + self.completion

    @property
    def state_bytes(self) -> int:
        return 16 if self.master else 12


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
    out = [m for m in (1, 2, 4, 8, 16, 32, 64) if m < hw.gpus_per_node and m <= n]
    m = hw.gpus_per_node
    while m <= n:
        out.append(m)
        m *= 2
    return out


def tp_of(m: int, hw: Hardware) -> int:
    return min(m, hw.gpus_per_node)


# ---- memory ----------------------------------------------------------------------------------
def trainer_memory(model: Model, wl: Workload, hw: Hardware, m: int, mb: int) -> float:
    tokens = mb * wl.seq
    per_layer = 2 * model.layers + 34 if wl.checkpointing else 34 * model.layers
    act = tokens * model.hidden * per_layer + tokens * model.vocab * 4
    return wl.state_bytes * model.params / m + act / tp_of(m, hw)


def kv_per_seq(model: Model, tokens: float) -> float:
    return 2 * model.layers * model.kv_heads * model.head_dim * KV_BYTES * tokens


def generator_memory(model: Model, wl: Workload, m: int, c: int, weight_bytes: float, resident=0.0) -> float:
    return weight_bytes * model.params / m + resident + c * kv_per_seq(model, wl.seq) / m


def max_concurrency(model, wl, hw, m, weight_bytes, resident=0.0) -> int:
    free = hw.usable - weight_bytes * model.params / m - resident
    return max(0, int(free * m // kv_per_seq(model, wl.seq)))


# ---- time ------------------------------------------------------------------------------------
class Profile:
    def __init__(self, data: dict | None = None):
        self.gen, self.train, self.gen_pts = {}, {}, {}
        self.gen_ratio = self.train_ratio = 1.0
        try:
            for p in (data or {}).get("generation", []):
                self.gen.setdefault(int(p["model_parallel"]), []).append(
                    (int(p["concurrency"]), float(p["seconds_per_step"])))
            for p in (data or {}).get("training", []):
                self.train[int(p["model_parallel"])] = float(p["seconds_per_token"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"profile: bad entry ({e!r}); the format is in `pydoc hfllamarl.plan`") from None
        if any(c <= 0 or t <= 0 for pts in self.gen.values() for c, t in pts) or min(self.train.values(), default=1) <= 0:
            raise PlanError("profile: concurrencies and times must be positive")

    def calibrate(self, gen_model, train_model) -> None:
        """measured / analytic ratios: per measured point, and geometric means for other sizes."""
        self.gen_pts = {m: sorted((c, t / gen_model(m, c)) for c, t in pts) for m, pts in self.gen.items()}
        ratios = [r for pts in self.gen_pts.values() for _, r in pts]
        self.gen_ratio = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0
        tr = [t / train_model(m) for m, t in self.train.items()]
        self.train_ratio = math.exp(sum(map(math.log, tr)) / len(tr)) if tr else 1.0

    def gen_factor(self, m: int, c: int) -> float:
        pts = self.gen_pts.get(m)
        if not pts:
            return self.gen_ratio
        if c <= pts[0][0]:
            return pts[0][1]
        for (c0, r0), (c1, r1) in zip(pts, pts[1:]):
            if c <= c1:
                return r0 + (r1 - r0) * (c - c0) / (c1 - c0)
        return pts[-1][1]


def decode_step(model, wl, hw, m, c, weight_bytes) -> float:
    tp = tp_of(m, hw)
    mem = weight_bytes * model.params / tp + c * kv_per_seq(model, wl.prompt + wl.completion / 2) / m
    t = max(mem / (hw.hbm * hw.bw_eff), 2 * model.params * c / (m * hw.flops * hw.mfu))
    if tp > 1:
        t += 2 * model.layers * (hw.lat_intra + 2 * (tp - 1) / tp * c * model.hidden * 2 / hw.nvlink)
    if m > tp:
        t += (m // tp - 1) * (hw.lat_inter + c * model.hidden * 2 / hw.inter)
    return t + STEP_OVERHEAD_S


def gen_time(model, wl, hw, prof, n, m, weight_bytes, resident=0.0):
    """(seconds, concurrency) to generate B completions on n GPUs in groups of m, or None if no fit."""
    c_max = max_concurrency(model, wl, hw, m, weight_bytes, resident)
    if c_max < 1 or n < m:
        return None
    seqs = math.ceil(wl.batch // wl.group / (n // m)) * wl.group
    waves = math.ceil(seqs / c_max)
    c = math.ceil(seqs / waves)
    prefill = 2 * model.params * wl.prompt * math.ceil(c / wl.group) / (m * hw.flops * hw.mfu)
    return waves * (prefill + wl.completion * decode_step(model, wl, hw, m, c, weight_bytes) * prof.gen_factor(m, c)), c


def microbatch_time(model, wl, hw, m, mb) -> float:
    """One micro-batch through one pipeline stage, forward + backward (+ recompute)."""
    tp, tokens = tp_of(m, hw), mb * wl.seq
    flops = (8 if wl.checkpointing else 6) * model.params * tokens
    t = flops / (m * hw.flops * hw.mfu * tokens / (tokens + 512))
    if tp > 1:
        ring = 2 * (tp - 1) / tp * tokens * model.hidden * 2 / hw.nvlink
        t += model.layers * tp / m * (6 if wl.checkpointing else 4) * (hw.lat_intra + ring)
    if m > tp:
        t += 2 * (hw.lat_inter + tokens * model.hidden * 2 / tp / hw.inter)  # activations to the next stage
    return t


def train_time(model, wl, hw, prof, n, m):
    """(seconds, micro-batch, accumulation steps) to train B samples on n GPUs in groups of m, or None."""
    if n < m:
        return None
    dp, pp = n // m, m // tp_of(m, hw)
    per_replica = math.ceil(wl.batch / dp)
    best, mb = None, 1
    while mb <= min(per_replica, 64):
        if trainer_memory(model, wl, hw, m, mb) <= hw.usable:
            k = math.ceil(per_replica / mb)
            if m in prof.train:
                t_mb = prof.train[m] * mb * wl.seq
            else:
                t_mb = microbatch_time(model, wl, hw, m, mb) * prof.train_ratio
            t = (k + pp - 1) * t_mb + (2 * (dp - 1) / dp * 2 * model.params / m / hw.inter if dp > 1 else 0.0)
            if best is None or t < best[0] * 0.999:
                best = (t, mb, k)
        mb *= 2
    return best


# ---- search ----------------------------------------------------------------------------------
def plan(model: Model, wl: Workload, hw: Hardware, n: int, prof: Profile | None = None) -> dict:
    prof = prof or Profile()
    prof.calibrate(lambda m, c: decode_step(model, wl, hw, m, c, wl.gen_bytes),
                   lambda m: microbatch_time(model, wl, hw, m, 1) / wl.seq)
    mps = mp_candidates(n, hw)
    train_best: dict[int, tuple] = {}  # GPUs -> ((seconds, mb, k), m): T_train and T_gen are separable
    gen_best: dict[int, tuple] = {}
    for m in mps:
        for size in range(m, n, m):
            t = train_time(model, wl, hw, prof, size, m)
            if t and (size not in train_best or t[0] < train_best[size][0][0] * 0.999):
                train_best[size] = (t, m)
            g = gen_time(model, wl, hw, prof, size, m, wl.gen_bytes)
            if g and (size not in gen_best or g[0] < gen_best[size][0][0] * 0.999):
                gen_best[size] = (g, m)
    best = None
    for nt, ((tt, mb, acc), mt) in train_best.items():
        if n - nt in gen_best:
            (tg, c), mg = gen_best[n - nt]
            key = (round(max(tt, tg), 9), tt + tg)
            if best is None or key < best[0]:
                best = (key, dict(trainer_gpus=nt, generator_gpus=n - nt, trainer_mp=mt, generator_mp=mg,
                                  micro_batch=mb, grad_accum=acc, decode_concurrency=c,
                                  train_s=tt, gen_s=tg, async_step_s=max(tt, tg)))
    if best is None:
        raise PlanError(not_fitting(model, wl, hw, n))
    out = best[1]
    out["trainer_mem_gb"] = trainer_memory(model, wl, hw, out["trainer_mp"], out["micro_batch"]) / 1e9
    out["generator_mem_gb"] = generator_memory(model, wl, out["generator_mp"], out["decode_concurrency"],
                                               wl.gen_bytes) / 1e9
    out.update(sync_plan(model, wl, hw, prof, n, mps))
    out["speedup"] = out["sync_step_s"] / out["async_step_s"] if out["sync_step_s"] else None
    return out


def sync_plan(model, wl, hw, prof, n, mps) -> dict:
    best = dict.fromkeys(("sync_mp", "sync_micro_batch", "sync_decode_concurrency", "sync_train_s", "sync_gen_s",
                          "sync_step_s", "sync_mem_gb"))
    optim = (wl.state_bytes - 4) * model.params  # Adam m, v and master weights: not the weights or the grads
    for m in (m for m in mps if n % m == 0):
        resident = 0.0 if wl.sync_offload else optim / m
        t, g = train_time(model, wl, hw, prof, n, m), gen_time(model, wl, hw, prof, n, m, 2, resident)
        if not t or not g:
            continue
        gen = g[0] + (2 * optim / m / hw.pcie if wl.sync_offload else 0.0)
        if best["sync_step_s"] is None or t[0] + gen < best["sync_step_s"] * 0.999:
            mem = max(trainer_memory(model, wl, hw, m, t[1]), generator_memory(model, wl, m, g[1], 2, resident))
            best = dict(sync_mp=m, sync_micro_batch=t[1], sync_decode_concurrency=g[1], sync_train_s=t[0],
                        sync_gen_s=gen, sync_step_s=t[0] + gen, sync_mem_gb=mem / 1e9)
    return best


def not_fitting(model, wl, hw, n) -> str:
    big = mp_candidates(1 << 20, hw)
    mt = next((m for m in big if trainer_memory(model, wl, hw, m, 1) <= hw.usable), None)
    mg = next((m for m in big if max_concurrency(model, wl, hw, m, wl.gen_bytes) >= 1), None)
    if mt is None or mg is None:
        return (f"one sequence of {wl.seq} tokens does not fit in {hw.memory / 1e9:.0f} GB GPUs at any model-parallel "
                f"size (activations or KV cache): shorten --prompt-length/--completion-length or use larger GPUs")
    msg = (f"{model.name} does not fit on {n} GPUs of {hw.memory / 1e9:.0f} GB: the trainer state alone is "
           f"{wl.state_bytes * model.params / 1e12:.2f} TB ({wl.state_bytes} B/param); it needs trainer "
           f"model-parallel size >= {mt} plus a generator group of >= {mg} GPUs, i.e. >= {mt + mg} GPUs")
    fits = [max(trainer_memory(model, wl, hw, a, 1), generator_memory(model, wl, b, 1, wl.gen_bytes))
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
    p.add_argument("--global-batch", type=int, default=2048, help="completions per step = prompts x group size")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--prompt-length", type=int, default=1024)
    p.add_argument("--completion-length", type=int, default=2048)
    p.add_argument("--generator-precision", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--no-master-weights", action="store_true", help="no fp32 master copy: 12 B/param, not 16")
    p.add_argument("--sync-offload", action="store_true", help="sync baseline offloads optimizer state to host")
    p.add_argument("--gpu-flops", type=float, default=989e12, help="peak dense bf16 FLOP/s (H100 SXM)")
    p.add_argument("--hbm-bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM)")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--bandwidth-efficiency", type=float, default=0.6, help="achieved / peak HBM in decode")
    p.add_argument("--memory-headroom", type=float, default=0.1, help="fraction of GPU memory kept free")
    p.add_argument("--profile", help="JSON of measured decode-step and training-token times (`pydoc hfllamarl.plan`)")


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
    for name in ("gpus", "gpus_per_node", "global_batch", "group_size", "prompt_length", "completion_length"):
        if getattr(args, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1")
    if args.global_batch % args.group_size:
        raise PlanError(f"--global-batch {args.global_batch} is not a multiple of --group-size {args.group_size}")
    if not (0 < args.mfu <= 1 and 0 < args.bandwidth_efficiency <= 1 and 0 <= args.memory_headroom < 1):
        raise PlanError("--mfu and --bandwidth-efficiency must be in (0, 1], --memory-headroom in [0, 1)")
    if args.gpus < 2:
        raise PlanError("an asynchronous split needs --gpus >= 2 (one trainer and one generator GPU)")
    model = model_from_config(args.model_config) if args.model_config else model_from_size(parse_size(args.model_size))
    hw = Hardware(parse_memory(args.gpu_memory), args.gpus_per_node, args.gpu_flops, args.hbm_bandwidth, args.mfu,
                  args.bandwidth_efficiency, args.memory_headroom)
    wl = Workload(args.global_batch, args.group_size, args.prompt_length, args.completion_length,
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
    out = {"model": model.name, "params": model.params, "gpus": args.gpus, **plan(model, wl, hw, args.gpus, prof),
           "generator_precision": args.generator_precision, "profile": bool(args.profile)}
    out = {k: round(v, 3) if isinstance(v, float) and k != "params" else v for k, v in out.items()}
    return out, render(out, model, wl, hw)


def render(o: dict, model: Model, wl: Workload, hw: Hardware) -> str:
    def s(x, unit=""):
        return "does not fit" if x is None else f"{x:.1f}{unit}" if isinstance(x, float) else f"{x}{unit}"

    rows = [("", "asynchronous (split)", "synchronous (co-located)"),
            ("trainer / generator GPUs", f"{o['trainer_gpus']} / {o['generator_gpus']}", f"{o['gpus']} shared"),
            ("model-parallel trainer / generator", f"{o['trainer_mp']} / {o['generator_mp']}", s(o["sync_mp"])),
            ("micro-batch (x grad accum)", f"{o['micro_batch']} (x{o['grad_accum']})", s(o["sync_micro_batch"])),
            ("decode concurrency per group", s(o["decode_concurrency"]), s(o["sync_decode_concurrency"])),
            ("memory/GPU trainer | generator", f"{o['trainer_mem_gb']:.1f} | {o['generator_mem_gb']:.1f} GB",
             s(o["sync_mem_gb"], " GB")),
            ("train time", s(o["train_s"], " s"), s(o["sync_train_s"], " s")),
            ("generation time", s(o["gen_s"], " s"), s(o["sync_gen_s"], " s")),
            ("step time", s(o["async_step_s"], " s"), s(o["sync_step_s"], " s"))]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    head = (f"{model.name}: {model.layers} layers, hidden {model.hidden}, {model.kv_heads} kv heads x "
            f"{model.head_dim}; {o['gpus']} GPUs x {hw.memory / 1e9:.0f} GB; batch {wl.batch} = "
            f"{wl.batch // wl.group} prompts x {wl.group}; {wl.prompt} + {wl.completion} tokens; generator "
            f"{o['generator_precision']}{'; measured profile' if o['profile'] else ''}")
    lines = [head] + [f"{a.ljust(w0)}  {b.ljust(w1)}  {c}" for a, b, c in rows]
    sp = o["speedup"]
    lines.append(f"predicted speed-up (sync / async): {sp:.2f}x" if sp else "predicted speed-up: sync does not fit")
    return "\n".join(lines)
