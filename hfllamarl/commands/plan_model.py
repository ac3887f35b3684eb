"""The memory and step-time formulas behind `hfllamarl plan` (the search and the command line are in
hfllamarl.commands.plan). Sizes in bytes, times in seconds; P parameters, L layers, h hidden, V vocab, kv x d
key/value heads x head dim, S = prompt + completion tokens, C completion tokens.

Generator group of m GPUs (vLLM): tp = min(m, gpus per node) tensor shards x pp = m / tp pipeline stages.
Trainer group: tp tensor shards (within a node) x an FSDP shard group (ZeRO-3: parameters, gradients and
optimizer state sharded); m_t = tp x fsdp GPUs hold one copy of the trained state, and N_t / m_t such groups
are data-parallel replicas (HSDP; m_t = N_t is plain FSDP over every trainer GPU, hfllamarl's own layout).
Every one of the N_t / tp TP groups trains its own micro-batches.

Trainer memory per GPU (must fit in (1 - headroom) x GPU memory; headroom 0.1: CUDA context, NCCL, fragmentation):
  state / m_t            16 B/param: bf16 weights 2 + grads 2, fp32 Adam m, v 4 + 4, master 4 (12 B without master)
  + FSDP working set / tp  (fsdp > 1) the root unit (embeddings + LM head, 2 V h, kept gathered from forward to
                         backward: FSDP2's default for the root) and two decoder layers (compute + prefetch) in bf16,
                         plus fp32 gradients of the largest unit before its reduce-scatter (hfllamarl.runtime.weights.fsdp reduces
                         in fp32): 2 (2 V h + 2 P_layer) + 4 max(2 V h, P_layer)
  + activations / tp     sequence parallel: mb S h (2 L + 34) with activation checkpointing (layer inputs kept,
                         one layer recomputed; Korthikanti et al. 2022 with flash attention), 34 L without,
                         + logits mb V (2 S + 12 C): bf16 logits of the sequence, and over the completion the fp32
                         copy, the log-softmax kept for backward and its gradient
                         (hfllamarl.runtime.training.batching.completion_logprobs).
Trainer time: each TP group trains ceil(B tp / N_t) samples as micro-batches of mb (the last one shorter),
T = mb S tokens each:
  T_train = sum of t_mb + HSDP gradient all-reduce across N_t / m_t replicas (fp32 over the network, once)
            + Adam step (reads and writes the state shard once: 2 x state / m_t over HBM)
  t_mb    = max(F + TP, FSDP) + 2 / (3 L) x FSDP   (the first gather and last reduce-scatter are not hidden)
  F   = f (P T + L h S^2 mb) / (tp x peak x MFU x T / (T + 512)),  f = 8 with checkpointing (6 + recompute) else 6;
        the second term is causal attention, T / (T + 512) the efficiency of small GEMMs
  TP  = L x (6 or 4) all-reduces of T h x 2 B over NVLink (latency + ring volume), tp > 1
  FSDP = 8 B/param / tp x (fsdp - 1) / fsdp per micro-batch (bf16 all-gather forward and backward, fp32
        reduce-scatter) over NVLink when m_t <= gpus per node, else over the network, + 3 L collective latencies.
  FSDP traffic per token does not depend on tp; TP pays off only when memory forbids a micro-batch long enough
  to hide the FSDP traffic, or when TP traffic is cheaper than the exposed FSDP traffic.

Generator memory per GPU: w P / m + c x KV_seq / kv_shards,  w = 2 (bf16) or 1 (fp8),
  KV_seq = 2 x L x kv x d x 2 B x S,  kv_shards = pp x min(tp, kv)  (KV heads are replicated beyond tp = kv).
Decode step of one group holding c sequences (all tokens of one step; per-GPU throughput = c / (m x t_step)):
  t_step = max((w P / tp + c KV_avg / kv_shards) / (HBM x eff), 2 P c / (m x peak x MFU))   data or compute
         + L x 30 us                       per-layer floor: ~10 kernels x ~3 us launch gap, ramp and tail each,
                                           even under CUDA graphs; it does not shrink with tp
         + 2 L x (lat(tp) + ring(c h 2 B)) + gather of c V x 2 B logits   (tp > 1)
         + c V x 16 B / (HBM x eff)        sampling: fp32 logits, about four passes, on every rank
         + (pp - 1) stage hops + 1 ms      scheduler, input preparation, output processing per step
  lat(k) = 6 us + 2 us x (k - 1) within a node (8 us at tp 2, 20 us at tp 8: NCCL's small-message all-reduce on
  8 x H100 NVSwitch takes 15-25 us, vLLM's custom all-reduce somewhat less), 30 us + 2 us x (k - 1) across nodes.
  KV_avg = KV at the mean context prompt + completion / 2. Pipeline stages hold P / m weights, but keeping
  every stage busy needs pp micro-batches, each reading the stage weights: w P / tp.
  eff = 0.8: large decode GEMVs stream about 80 % of peak HBM bandwidth; the fixed costs above, which a single
  lower efficiency would otherwise have to absorb, are counted separately. With every cost included, one
  sequence of an 8B model decodes at 7.9 ms per token at tp 1 (61 % of the HBM roofline; a published vLLM sweep
  of Llama-3.1-8B on an A100 measures 77 %, johnmusgrave.com/p/vllm-throughput-latency-sweep-on) and 4.0 ms at
  tp 8, not 1 ms. With B sequences on N_g GPUs a GPU holds c / m = B / N_g of them: at small c the weights read
  every step dominate, and tp divides them; at large c the KV cache per GPU (the same at every tp) and compute
  dominate, and tp only adds all-reduces, logits gathers and sampling of a larger batch per engine: per-GPU
  throughput then falls with tp, as in vLLM's serving benchmarks, where data parallelism beats tensor
  parallelism once the model fits (e.g. Lambda's vLLM benchmark of Llama 3.1 on 1-8 H100s).
Generation: a prompt's G samples stay on one of the N_g / m groups; a group with n sequences decodes them in
ceil(n / c_max) waves (c_max from the memory left for KV), each wave = prefill (compute bound, the prompt
shared by its G samples) + completion x t_step.
Defaults: H100-80GB SXM, 989 TFLOPS dense bf16, 3.35 TB/s HBM, MFU 0.4, NVLink 450 GB/s, 50 GB/s per GPU
between nodes (400 Gb/s NIC), PCIe 25 GB/s. Weight sync and reward time are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KV_BYTES = 2  # bf16 KV cache
SMALL_GEMM_TOKENS = 512  # T / (T + 512): GEMM efficiency at T tokens


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
    bw_eff: float = 0.8
    headroom: float = 0.1
    nvlink: float = 450e9
    inter: float = 50e9
    lat_intra: float = 6e-6  # a collective within a node: launch and synchronisation
    lat_inter: float = 30e-6  # ... across nodes
    lat_hop: float = 2e-6  # per further rank of the ring
    layer_floor: float = 30e-6  # per decoder layer and decode step
    step_overhead: float = 1e-3  # per decode step: scheduler, input preparation, outputs
    pcie: float = 25e9

    @property
    def usable(self) -> float:
        return self.memory * (1 - self.headroom)


@dataclass
class Workload:
    batch: int  # completions per step
    group: int  # completions per prompt
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


def tp_of(m: int, hw: Hardware) -> int:
    return min(m, hw.gpus_per_node)


def collective_latency(hw: Hardware, ranks: int, across_nodes: bool) -> float:
    return (hw.lat_inter if across_nodes else hw.lat_intra) + hw.lat_hop * (ranks - 1)


def ring_time(hw: Hardware, ranks: int, nbytes: float, bandwidth: float) -> float:
    """An all-reduce of nbytes on one ring: 2 (k - 1) / k x nbytes per GPU."""
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth


# ---- trainer --------------------------------------------------------------------------------
def layer_params(model: Model) -> float:
    return max(model.params - 2 * model.vocab * model.hidden, model.params / 2) / model.layers


def activation_bytes(model: Model, wl: Workload, mb: int) -> float:
    per_layer = 2 * model.layers + 34 if wl.checkpointing else 34 * model.layers
    logits = model.vocab * (2 * wl.seq + 12 * wl.completion)
    return mb * (wl.seq * model.hidden * per_layer + logits)


def fsdp_working_set(model: Model) -> float:
    root, layer = 2 * model.vocab * model.hidden, layer_params(model)
    return 2 * (root + 2 * layer) + 4 * max(root, layer)


def trainer_memory(model: Model, wl: Workload, hw: Hardware, m: int, tp: int, mb: int) -> float:
    """Per GPU: trainer state sharded over the m = tp x fsdp GPUs of a group, working set, activations."""
    mem = wl.state_bytes * model.params / m + activation_bytes(model, wl, mb) / tp
    return mem + (fsdp_working_set(model) / tp if m > tp else 0.0)


def compute_time(model: Model, wl: Workload, hw: Hardware, tp: int, mb: int) -> float:
    """Forward + backward (+ recompute) of one micro-batch on one TP group, with its TP all-reduces."""
    tokens, f = mb * wl.seq, (8 if wl.checkpointing else 6)
    flops = f * (model.params * tokens + model.layers * model.hidden * wl.seq ** 2 * mb)
    t = flops / (tp * hw.flops * hw.mfu * tokens / (tokens + SMALL_GEMM_TOKENS))
    if tp > 1:
        per = collective_latency(hw, tp, False) + ring_time(hw, tp, tokens * model.hidden * 2, hw.nvlink)
        t += model.layers * (6 if wl.checkpointing else 4) * per
    return t


def fsdp_time(model: Model, hw: Hardware, m: int, tp: int) -> float:
    """FSDP traffic of one micro-batch per GPU: gathers forward and backward, reduce-scatter of fp32 grads."""
    shards = m // tp
    if shards == 1:
        return 0.0
    across = m > hw.gpus_per_node
    volume = 8 * model.params / tp * (shards - 1) / shards
    return volume / (hw.inter if across else hw.nvlink) + 3 * model.layers * collective_latency(hw, shards, across)


def microbatch_time(compute: float, fsdp: float, model: Model) -> float:
    return max(compute, fsdp) + fsdp * 2 / (3 * model.layers)


def step_fixed_time(model: Model, wl: Workload, hw: Hardware, n: int, m: int) -> float:
    """Once per optimizer step: HSDP gradient all-reduce across the n / m replicas (fp32) and the Adam step."""
    t = 2 * wl.state_bytes * model.params / m / hw.hbm
    replicas = n // m
    if replicas > 1:
        t += ring_time(hw, replicas, 4 * model.params / m, hw.inter) + 2 * collective_latency(hw, replicas, True)
    return t


# ---- generator ------------------------------------------------------------------------------
def kv_per_seq(model: Model, tokens: float) -> float:
    return 2 * model.layers * model.kv_heads * model.head_dim * KV_BYTES * tokens


def kv_shards(model: Model, hw: Hardware, m: int) -> int:
    tp = tp_of(m, hw)
    return m // tp * min(tp, model.kv_heads)


def generator_memory(model: Model, wl: Workload, hw: Hardware, m: int, c: int, weight_bytes: float,
                     resident: float = 0.0) -> float:
    return weight_bytes * model.params / m + resident + c * kv_per_seq(model, wl.seq) / kv_shards(model, hw, m)


def max_concurrency(model: Model, wl: Workload, hw: Hardware, m: int, weight_bytes: float,
                    resident: float = 0.0) -> int:
    free = hw.usable - weight_bytes * model.params / m - resident
    return max(0, int(free * kv_shards(model, hw, m) // kv_per_seq(model, wl.seq)))


def decode_step(model: Model, wl: Workload, hw: Hardware, m: int, c: int, weight_bytes: float) -> float:
    """One decode step (one token for each of c sequences) of a group of m GPUs."""
    tp = tp_of(m, hw)
    bw = hw.hbm * hw.bw_eff
    data = weight_bytes * model.params / tp + c * kv_per_seq(model, wl.prompt + wl.completion / 2) / kv_shards(
        model, hw, m)
    t = max(data / bw, 2 * model.params * c / (m * hw.flops * hw.mfu)) + model.layers * hw.layer_floor
    if tp > 1:
        per = collective_latency(hw, tp, False) + ring_time(hw, tp, c * model.hidden * 2, hw.nvlink)
        t += 2 * model.layers * per
        t += collective_latency(hw, tp, False) + (tp - 1) / tp * c * model.vocab * 2 / hw.nvlink  # logits
    t += c * model.vocab * 16 / bw  # sampling
    if m > tp:
        t += (m // tp - 1) * (hw.lat_inter + c * model.hidden * 2 / hw.inter)
    return t + hw.step_overhead


def decode_tokens_per_gpu(model: Model, wl: Workload, hw: Hardware, m: int, c: int, weight_bytes: float) -> float:
    return c / (m * decode_step(model, wl, hw, m, c, weight_bytes))


def prefill_time(model: Model, wl: Workload, hw: Hardware, m: int, c: int) -> float:
    return 2 * model.params * wl.prompt * math.ceil(c / wl.group) / (m * hw.flops * hw.mfu)


# ---- measured profile -----------------------------------------------------------------------
class Profile:
    """Measured decode-step and training-token times (`--profile`; format in `pydoc hfllamarl.commands.plan`)."""

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
            raise PlanError(f"profile: bad entry ({e!r}); the format is in `pydoc hfllamarl.commands.plan`") from None
        bad_gen = any(c <= 0 or t <= 0 for pts in self.gen.values() for c, t in pts)
        if bad_gen or min(self.train.values(), default=1) <= 0:
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

    def compute_time(self, model: Model, wl: Workload, hw: Hardware, tp: int, mb: int) -> float:
        if tp in self.train:
            return self.train[tp] * mb * wl.seq
        return compute_time(model, wl, hw, tp, mb) * self.train_ratio
