"""The trainer's attention kernel on a CPU: PyTorch's fused SDPA, or the plain matmul-softmax-matmul where that is
measured faster.

On a CPU in bf16 (or fp16), PyTorch's fused attention (`scaled_dot_product_attention`, transformers' default "sdpa")
runs the short rows of RL training slowly: measured on a 2-core AMD EPYC (Zen 4, avx512_bf16), forward and backward
of 8 heads of 64 over rows of 64 / 128 / 256 / 512 / 1024 tokens took 3.3x / 2.0x / 1.25x / 1.09x / 0.73x the time
of the same attention written as two matrix products and a softmax (transformers' "eager"); in fp32 the two are
even. The whole bench model's forward and backward (18.7M Llama, 13 rows of 100 tokens) took 12 % less. A decoding
step (one query row over 20-120 cached keys, 16 sequences) took 2-4x as long in SDPA.

So the trainer's policy (and reference model) on a CPU runs `attention_forward`, registered with transformers as
"hfllamarl_sdpa" (`use_fast_cpu_attention`; masks as for "sdpa"): each call takes SDPA unless it is, in a
half-precision dtype over at most `LONGEST` keys, a training-shaped call (queries as long as the keys) or a decoding
step (one query row: the trainer's own sampling, `bootstrap`), and the plain form was measured faster for that shape
on this machine: once per process for each (dtype, heads, head size, key length rounded up to a power of two,
decoding or not), both forms on random inputs (forward and backward; 20 forwards for decoding), the plain one kept
if it took under 90 % of SDPA's time (`_plain_is_faster`; the measured times are logged). Longer rows always take
SDPA (the plain form holds rows x rows scores per head). Both compute the same function; they round differently
in bf16 (as any two kernels do), so which one a bf16 run takes rests on this machine's measurement. A model whose
attention was named in `model_init_kwargs` keeps it (name one for a fixed kernel); a GPU keeps SDPA.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

NAME = "hfllamarl_sdpa"
LONGEST = 512  # rows longer than this always take SDPA
_HALF = (torch.bfloat16, torch.float16)
_UNHANDLED = ("position_bias", "cache", "s_aux", "sinks", "softcap", "output_attentions")
_choice: dict[tuple, bool] = {}  # (dtype, heads, head size, key bucket, decoding) -> the plain form is faster


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    """transformers' attention-function contract (query, key, value `[B, heads, T, D]`; returns `[B, T, heads, D]`
    and no weights), as "sdpa" with its masks: None (causal), a boolean 4-D mask (True: attend) or an additive one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _takes_plain(module, query, key, attention_mask, dropout, kwargs):
        return _plain(module, query, key, value, attention_mask, scaling, is_causal), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_fast_cpu_attention(model, device: torch.device, named: bool) -> bool:
    """Switch `model` (loaded with transformers' default "sdpa") to `attention_forward` when it trains on a CPU and
    its attention was not named by the user (`named`); returns whether it did."""
    config = getattr(model, "config", None)
    if named or device.type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa" \
            or not hasattr(model, "set_attn_implementation"):
        return False
    register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, NotImplementedError) as exc:  # (a model whose attention cannot be swapped keeps its own)
        logger.info("the trainer keeps SDPA attention: %s", exc)
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME


def register() -> None:
    """Register `attention_forward` as "hfllamarl_sdpa" with transformers, with SDPA's mask function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


# ---------------------------------------------------------------------------- the plain form, where it pays
def _takes_plain(module, query, key, attention_mask, dropout: float, kwargs: dict) -> bool:
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    if query.device.type != "cpu" or dtype not in _HALF or (dropout and module.training):
        return False
    rows, length = query.shape[2], key.shape[2]
    if rows not in (1, length) or length > LONGEST or length < 2 or any(kwargs.get(k) is not None for k in _UNHANDLED):
        return False  # (rows 1: a decoding step, the trainer's own sampling; else a training-shaped call)
    if attention_mask is not None and attention_mask.dim() != 4:
        return False
    return _plain_is_faster(dtype, query.shape[1], query.shape[-1], _bucket(length), decoding=rows == 1)


def _plain(module, query, key, value, attention_mask, scaling: float | None, is_causal: bool | None):
    """softmax(q k^T * scale + mask) v, the softmax in fp32 (as transformers' eager attention); `[B, T, heads, D]`."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    lowest = torch.finfo(scores.dtype).min  # (not -inf: a row with nothing to attend to stays finite, as in eager)
    if attention_mask is None:  # (one query row, a decoding step, attends to every key, as in SDPA)
        if scores.shape[-2] > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
            length = scores.shape[-1]
            causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~causal, lowest)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, lowest)
    else:
        scores = scores + attention_mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def _bucket(length: int) -> int:
    return max(64, 1 << (int(length) - 1).bit_length())


def _plain_is_faster(dtype: torch.dtype, heads: int, head_size: int, bucket: int, decoding: bool = False) -> bool:
    """Measured once per process and shape: forward and backward of both forms over ~1024 tokens of rows of `bucket`
    tokens (causal), or with `decoding` the forward of one query row over `bucket` keys for 16 sequences; the best
    of two runs after one warm-up each; the plain form if it took under 90 % of SDPA's time."""
    key = (dtype, int(heads), int(head_size), int(bucket), bool(decoding))
    if key not in _choice:
        import torch.nn.functional as F

        g = torch.Generator().manual_seed(0)
        if decoding:
            q = torch.randn(16, heads, 1, head_size, generator=g).to(dtype)
            k, v = (torch.randn(16, heads, bucket, head_size, generator=g).to(dtype) for _ in range(2))
        else:
            shape = (max(1, 1024 // bucket), heads, bucket, head_size)
            q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3))
        module = torch.nn.Module()

        def fused():
            return F.scaled_dot_product_attention(q, k, v, is_causal=not decoding).transpose(1, 2)

        def plain():
            return _plain(module, q, k, v, None, None, not decoding)

        def once(run):
            if decoding:
                with torch.no_grad():
                    for _ in range(20):
                        run()
            else:
                with torch.enable_grad():
                    run().float().sum().backward()

        seconds = {}
        # The first call of a shape usually comes inside the model's forward: under gradient checkpointing that
        # forward's saved tensors are packed by the checkpoint's hooks, and its recomputation (which finds the
        # choice made) must save the same ones. The measurement's own tensors are kept out of them.
        with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            for name, run in (("sdpa", fused), ("plain", plain)):
                times = []
                for _ in range(3):
                    start = time.perf_counter()
                    once(run)
                    times.append(time.perf_counter() - start)
                seconds[name] = min(times[1:])
        _choice[key] = seconds["plain"] < 0.9 * seconds["sdpa"]
        logger.info("trainer attention on this CPU, %s, %d heads of %d, %s up to %d tokens: %s (%s %.2f ms plain, "
                    "%.2f ms SDPA)", str(dtype).replace("torch.", ""), heads, head_size,
                    "decoding over keys" if decoding else "rows", bucket,
                    "plain matmul-softmax" if _choice[key] else "SDPA",
                    "20 decoding steps" if decoding else "forward and backward", 1e3 * seconds["plain"],
                    1e3 * seconds["sdpa"])
    return _choice[key]


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
