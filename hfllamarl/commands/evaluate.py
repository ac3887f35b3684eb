"""`hfllamarl eval`: generate with vLLM on a JSONL data set and score with a reward plugin.

    hfllamarl eval --model PATH --data FILE.jsonl [--samples N] [--limit K] [--reward NAME]
                   [--output OUT.jsonl] [--max-tokens T] [--temperature X] [--seed S]

The data file is MATH-shaped (`problem`, `answer`), GSM8K-shaped (`question`, `answer` ending in
`#### N`) or has a `prompt` column; the shape is told from the columns and decides the prompt and
the default reward (`math_sympy`, `gsm8k`); see :mod:`hfllamarl.commands.eval_data`. MATH and GSM8K
questions are followed by "Solve the problem step by step. Put your final answer within \\boxed{}."
and sent as a user message when the tokenizer has a chat template, else as plain text.

vLLM runs in this process (as the generator executor runs it). A prompt that leaves fewer than
`--max-tokens` tokens of the model's context is skipped and counted, not generated. Every
completion is scored by the reward (called once per problem, with the row's columns as keywords,
as TRL calls it); accuracy (= pass@1) is the mean reward over all scored completions, and with
`--samples N > 1` "any correct" is the fraction of problems with at least one completion whose
reward is >= 1.

Output: a short table, the path of the per-problem results (JSONL; default `eval_results.jsonl`
in the current directory), and as the last line of stdout one JSON object with the summary.
Exit status 0, or 2 for a data file or reward name that cannot be used.

This module stays light at import time: vLLM, torch and transformers are imported in `run`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Sequence

DEFAULT_OUTPUT = "eval_results.jsonl"
CPU_KV_CACHE_BYTES = 256 << 20


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="model directory or hub name (as vLLM loads it)")
    parser.add_argument("--data", required=True, help="JSONL file: MATH (problem, answer), GSM8K (question, "
                        "answer) or rows with a `prompt` column")
    parser.add_argument("--samples", type=int, default=1, help="completions per problem (default 1)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first K rows")
    parser.add_argument("--reward", default=None, help="reward plugin (default: math_sympy for MATH, gsm8k for GSM8K)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help=f"per-problem results, JSONL (default: ./{DEFAULT_OUTPUT})")
    parser.add_argument("--max-tokens", type=int, default=1024, help="most tokens per completion (default 1024)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: 0, greedy, for one sample; 1.0 for several)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0); each problem derives its own")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length for vLLM (default: the model config's max_position_embeddings)")
    parser.add_argument("--dtype", default="auto", help="vLLM dtype (default auto)")


def model_context_length(model: str) -> int:
    """The model's context length from its config (`max_position_embeddings` or a known alias)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"Cannot tell {model}'s context length from its config; pass --max-model-len.")


def summarize(rewards: Sequence[Sequence[float | None]], samples: int) -> dict[str, Any]:
    """Accuracy (= pass@1, the mean over scored completions), "any correct" (the fraction of problems
    with a completion scoring >= 1; None unless samples > 1) and the count of unscored completions."""
    scored = [r for per in rewards for r in per if r is not None]
    accuracy = sum(scored) / len(scored) if scored else None
    any_correct = None
    if samples > 1 and rewards:
        any_correct = sum(any(r is not None and r >= 1.0 for r in per) for per in rewards) / len(rewards)
    return {
        "accuracy": accuracy,
        "pass@1": accuracy,
        "any_correct": any_correct,
        "unscored": sum(len(per) for per in rewards) - len(scored),
    }


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _build_engine(args, max_model_len: int):
    import torch

    from hfllamarl.runtime.generation.engine import build_engine

    on_cpu = not torch.cuda.is_available()
    return build_engine(args.model, args.model, dtype=args.dtype, seed=args.seed, max_model_len=max_model_len,
                        tensor_parallel_size=1, distributed=False, use_cpu=on_cpu, kv_cache_bytes=CPU_KV_CACHE_BYTES,
                        gpu_memory_utilization=0.85)


def request_seed(seed: int, row_index: int, samples: int) -> int:
    """The sampling seed of row `row_index`; vLLM gives its j-th sample `request_seed + j`, so every
    completion of a run has its own seed and a problem's samples do not depend on --limit."""
    return (seed * 1_000_003 + row_index * samples) % (1 << 31)


def _generate(llm, rows: list[int], prompt_ids: list[list[int]], args, temperature: float):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(n=args.samples, temperature=temperature, max_tokens=args.max_tokens,
                             seed=request_seed(args.seed, i, args.samples)) for i in rows]
    return llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params,
                        use_tqdm=sys.stderr.isatty())


def run(args) -> int:
    from .eval_data import EvalDataError
    from hfllamarl.registry import PluginError

    try:
        return _run(args)
    except (EvalDataError, PluginError) as exc:
        print(f"hfllamarl eval: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from hfllamarl import load_plugin
    from hfllamarl.runtime.data.prompts import PromptEncoder

    from .eval_data import (EvalDataError, build_prompt, check_rows, columns_of, default_reward, detect_shape,
                            gold_answer, read_jsonl, score_completions)

    start = time.perf_counter()
    if args.samples < 1:
        raise EvalDataError("--samples must be at least 1.")
    if args.limit is not None and args.limit < 1:
        raise EvalDataError("--limit must be at least 1.")
    if args.max_tokens < 1:
        raise EvalDataError("--max-tokens must be at least 1.")
    rows = read_jsonl(args.data, args.limit)
    shape = detect_shape(columns_of(rows))
    check_rows(rows, shape)
    reward_name = args.reward or default_reward(shape, rows)
    reward_fn = load_plugin("rewards", reward_name)
    temperature = args.temperature if args.temperature is not None else (0.0 if args.samples == 1 else 1.0)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    max_model_len = args.max_model_len or model_context_length(args.model)
    if args.max_tokens >= max_model_len:
        raise EvalDataError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's context of "
                            f"{max_model_len} tokens.")
    built = [build_prompt(row, shape, tokenizer) for row in rows]
    encoder = PromptEncoder(tokenizer)  # the token ids training would give the same prompt
    ids = [encoder.encode(prompt) for prompt, _ in built]
    keep = [i for i, x in enumerate(ids) if 0 < len(x) <= max_model_len - args.max_tokens]
    skipped = len(rows) - len(keep)

    texts: dict[int, list[str]] = {}
    comp_ids: dict[int, list[list[int]]] = {}
    finish: dict[int, list[str]] = {}
    gen_seconds = 0.0
    if keep:
        llm = _build_engine(args, max_model_len)
        gen_start = time.perf_counter()
        outputs = _generate(llm, keep, [ids[i] for i in keep], args, temperature)
        gen_seconds = time.perf_counter() - gen_start
        for i, out in zip(keep, outputs):
            texts[i] = [c.text for c in out.outputs]
            comp_ids[i] = [list(c.token_ids) for c in out.outputs]
            finish[i] = [str(c.finish_reason or "length") for c in out.outputs]
        del llm, outputs

    score_start = time.perf_counter()
    rewards = score_completions(reward_fn, [rows[i] for i in keep], [built[i][0] for i in keep],
                                [texts[i] for i in keep], [comp_ids[i] for i in keep])
    score_seconds = time.perf_counter() - score_start
    by_row = dict(zip(keep, rewards))
    tokens = sum(len(c) for per in comp_ids.values() for c in per)

    output = os.path.abspath(args.output)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w", encoding="utf-8") as fh:
        for i, row in enumerate(rows):
            per = by_row.get(i, [])
            scored = [r for r in per if r is not None]
            item = {
                "index": i,
                "prompt": built[i][1],
                "gold": gold_answer(row),
                "skipped": i not in by_row,
                "prompt_tokens": len(ids[i]),
                "mean_reward": sum(scored) / len(scored) if scored else None,
                "completions": [
                    {"text": t, "reward": r, "tokens": len(c), "finish_reason": f}
                    for t, r, c, f in zip(texts.get(i, []), per, comp_ids.get(i, []), finish.get(i, []))
                ],
            }
            fh.write(json.dumps(item, ensure_ascii=False) + "\n")

    seconds = time.perf_counter() - start
    summary: dict[str, Any] = {
        **summarize(rewards, args.samples),
        "problems": len(keep),
        "completions": sum(len(per) for per in rewards),
        "skipped": skipped,
        "samples": args.samples,
        "seconds": round(seconds, 3),
        "generation_seconds": round(gen_seconds, 3),
        "scoring_seconds": round(score_seconds, 3),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / gen_seconds, 2) if gen_seconds > 0 else None,
        "reward": reward_name,
        "shape": shape,
        "temperature": temperature,
        "max_tokens": args.max_tokens,
        "max_model_len": max_model_len,
        "model": args.model,
        "data": os.path.abspath(args.data),
        "output": output,
    }
    stats = getattr(reward_fn, "stats", None)
    if callable(stats):
        summary["reward_timeouts"] = stats().get("timeouts", 0)
    _print_table(summary)
    print(json.dumps(summary), flush=True)
    return 0


def _print_table(s: dict[str, Any]) -> None:
    rows = [
        ("problems", str(s["problems"])),
        ("completions", f"{s['completions']}  ({s['samples']} per problem)"),
        ("skipped", f"{s['skipped']}  (prompt + max_tokens > context {s['max_model_len']})"),
        ("accuracy", f"{_fmt(s['accuracy'])}  (pass@1, mean {s['reward']} reward)"),
        ("any correct", _fmt(s["any_correct"]) + ("" if s["samples"] == 1 else f"  (pass@{s['samples']})")),
        ("seconds", f"{s['seconds']:.1f}  (generation {s['generation_seconds']:.1f}, "
                    f"scoring {s['scoring_seconds']:.1f})"),
        ("tokens/s", _fmt(s["tokens_per_s"], ".1f") + f"  ({s['completion_tokens']} completion tokens)"),
    ]
    if s["unscored"]:
        why = "the reward returned None: no gold answer, or its check did not finish in time"
        rows.insert(4, ("unscored", f"{s['unscored']}  ({why})"))
    print(f"hfllamarl eval  {os.path.basename(s['data'])} ({s['shape']})  model {s['model']}")
    for name, value in rows:
        print(f"  {name:<12} {value}")
    print(f"results: {s['output']}", flush=True)
