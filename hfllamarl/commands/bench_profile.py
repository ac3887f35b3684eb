"""`hfllamarl bench profile`: measure this machine's decode-step and training-token times for `plan --profile`.

    hfllamarl bench profile --model DIR --out profile.json [--concurrency 1,4,16] [--decode-tokens 16]

Decode: the real vLLM engine (one process, tensor-parallel size 1) generates `--decode-tokens` more tokens
for `c` random prompts at each concurrency c (ignore_eos, no prefix caching); one decode step is the time
difference between two runs that differ only in their token count, divided by that difference, so prefill
and start-up cancel; each length's time is the fastest of `--repeats` runs after a warm-up run, which
discounts other load on the machine. Training: the transformers model trains micro-batches of
`--train-micro-batch` random sequences of `--train-length` tokens: forward, the trainer's log-prob loss
(fp32 log-softmax of the logits), backward (with activation checkpointing unless
--no-activation-checkpointing, as `plan` assumes) and an AdamW step; seconds per trained token is the fastest
of `--train-steps` step times (after a warm-up step) over the tokens of a micro-batch.

The file has the format `hfllamarl plan --profile` reads (`pydoc hfllamarl.commands.plan`), model-parallel size 1,
plus a "measured_on" record of the machine and settings. The last printed line is the same JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="directory of a Hugging Face Llama-like model")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated decode concurrencies")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=16, help="extra tokens whose time gives the step time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-micro-batch", type=int, default=4)
    p.add_argument("--train-length", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--train-steps", type=int, default=5, help="timed optimizer steps (after one warm-up step)")
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--dtype", default=None, help="float32 (default on CPU) or bfloat16 (default on GPU)")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="vLLM KV cache on CPU (default 256 MiB)")
    p.add_argument("--seed", type=int, default=0)


def _vocab_and_length(model_dir: str) -> tuple[int, int]:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings") or 2048)


def measure_decode(args, concurrencies: list[int], dtype: str, on_gpu: bool) -> list[dict]:
    import random

    from hfllamarl.runtime.generation.engine import build_engine

    vocab, max_len = _vocab_and_length(args.model)
    short, long = 2, 2 + args.decode_tokens
    llm = build_engine(args.model, args.model, dtype=dtype, seed=args.seed,
                       max_model_len=min(max_len, args.prompt_length + long), tensor_parallel_size=1,
                       distributed=False, use_cpu=not on_gpu, kv_cache_bytes=args.kv_cache_bytes,
                       gpu_memory_utilization=0.85, enable_prefix_caching=False, max_num_seqs=max(concurrencies))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(args.seed)

    def timed(c: int, tokens: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(args.prompt_length)])
                   for _ in range(c)]
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=1.0,
                                seed=args.seed)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    points = []
    for c in concurrencies:
        timed(c, long)  # warm-up at this concurrency
        runs = [(timed(c, long), timed(c, short)) for _ in range(args.repeats)]
        step = (min(r[0] for r in runs) - min(r[1] for r in runs)) / (long - short)
        points.append({"model_parallel": 1, "concurrency": c, "seconds_per_step": max(step, 1e-7)})
    return points


def measure_training(args, dtype: str, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    vocab, _ = _vocab_and_length(args.model)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype)).to(device)
    model.config.use_cache = False
    if not args.no_activation_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, vocab, (args.train_micro_batch, args.train_length), device=device)

    def step() -> float:
        start = time.perf_counter()
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up
    seconds = min(step() for _ in range(args.train_steps))
    return {"model_parallel": 1, "seconds_per_token": seconds / (args.train_micro_batch * args.train_length)}


def run(args) -> int:
    try:
        concurrencies = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        concurrencies = []
    if not concurrencies or min(concurrencies) < 1 or min(args.decode_tokens, args.repeats, args.train_micro_batch,
                                                           args.train_length, args.train_steps, args.prompt_length) < 1:
        print("hfllamarl bench profile: error: concurrencies, token counts, repeats and steps must be >= 1",
              file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"hfllamarl bench profile: error: no config.json in {args.model}", file=sys.stderr)
        return 2
    import platform

    import torch

    on_gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    generation = measure_decode(args, concurrencies, dtype, on_gpu)
    training = measure_training(args, dtype, "cuda" if on_gpu else "cpu")
    import vllm

    cpu = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    profile = {
        "generation": generation,
        "training": [training],
        "measured_on": {"model": os.path.abspath(args.model), "dtype": dtype, "vllm": vllm.__version__,
                        "device": torch.cuda.get_device_name(0) if on_gpu else cpu,
                        "prompt_length": args.prompt_length, "decode_tokens": args.decode_tokens,
                        "train_micro_batch": args.train_micro_batch, "train_length": args.train_length,
                        "activation_checkpointing": not args.no_activation_checkpointing},
    }
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
    for p in generation:
        print(f"decode  concurrency {p['concurrency']:4d}: {p['seconds_per_step'] * 1e3:8.3f} ms/step "
              f"({p['concurrency'] / p['seconds_per_step']:.0f} tokens/s)")
    print(f"train   micro-batch {args.train_micro_batch} x {args.train_length}: "
          f"{training['seconds_per_token'] * 1e6:.2f} us/token; wrote {args.out}")
    print(json.dumps(profile))
    return 0
