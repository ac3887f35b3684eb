"""Checks of multi-turn rollouts on a real vLLM generator in one process, without a trainer.

    python tests/scripts/agentic_checks.py MODEL_DIR WORKDIR     (prints one line: RESULT {json})

MODEL_DIR is the tiny Qwen3-template model warmed up on the calculator format. One engine serves every check:

`rows`: 2 batches of calculator prompts with `tools=[calculator]`, 80 tokens per completion at 16 per tick, so a
rollout spans up to 5 ticks; the weights change between ticks (versions 1..4: the base weights plus noise).
Every token the policy sampled is scored again with transformers under the weights of the version it says sampled
it (pi must equal mu), every tool token must be what Qwen3's template writes for a tool result (hand-written
below), and the trainer's loss mask must be 1 exactly on the sampled tokens.

`checkpoint`: an environment per rollout (it records its calls); after two ticks the generator's state is
saved as a checkpoint saves it, loaded into a fresh executor, and continued: each environment must come back with
its calls, and its reward must count the calls of the whole rollout.

`hang`: a tool that never returns and one that raises, with a 1 s bound: every rollout finishes, the model reads
the errors, the tick takes seconds.

`evaluation`: evaluation during training with tools (12 prompts x 3, the warmed-up weights):
multi-turn, finished within the tick even with a per-tick budget.
"""

import json
import os
import sys
import time
from types import SimpleNamespace

import torch

from hfllamarl.runtime.loop.sampling import Sampling
from hfllamarl.runtime.loop.schedule import Schedule

LENGTH, BUDGET, TEMPERATURE = 80, 16, 1.0
CALLS = {"n": 0}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12+30".
    """
    from hfllamarl.plugins.environments.calculator import evaluate

    return evaluate(expression)


def stuck_calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12+30".
    """
    CALLS["n"] += 1
    if CALLS["n"] % 2:
        time.sleep(3600)
    raise RuntimeError("out of order")


stuck_calculator.__name__ = "calculator"  # the name the model calls


class Recorder:
    """An environment that records the expressions it was called with, and how many of those calls failed."""

    def __init__(self):
        self.expressions, self.failed = [], 0

    def reset(self, **row):
        self.expressions, self.failed = [], 0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "12+30".
        """
        self.expressions.append(expression)
        try:
            return calculator(expression)
        except Exception:
            self.failed += 1
            raise

    def get_reward(self) -> float:
        return float(len(self.expressions))


def generator(path: str, rows: list, agent, engine=None, length: int = LENGTH, **spec_kw):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from hfllamarl.runtime.generation.generator import GeneratorExecutor, GeneratorSpec
    from hfllamarl.runtime.agents.multi_turn import MultiTurn
    from hfllamarl.runtime.data.prompts import PromptEncoder

    kwargs = {"enable_thinking": False}
    spec = GeneratorSpec(model_path=path, tokenizer_path=path, dataset=Dataset.from_list(rows), max_model_len=512,
                         dtype="float32", chat_template_kwargs=kwargs, sampling=Sampling(temperature=TEMPERATURE),
                         max_completion_length=length, agent=agent, **spec_kw)
    topology = SimpleNamespace(num_generators=1, replica_size=1, num_replicas=1, replica=0, use_cpu=True,
                               local_rank=0, rank=0, timeout=None)
    gen = GeneratorExecutor(spec, topology)
    gen.dataset, gen.llm = spec.dataset, engine or gen._build_engine()
    gen.encoder = PromptEncoder(AutoTokenizer.from_pretrained(path), kwargs)
    gen.agent = MultiTurn(agent, gen)
    return gen


def versions_of(model, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    return [base] + [{k: t + 0.05 * t.float().std().clamp(min=1e-2) * torch.randn(t.shape, generator=g)
                      for k, t in base.items()} for _ in range(count)]


def run_ticks(gen, ticks: int, weights=None) -> list:
    from hfllamarl.runtime.loop.weights_channel import POLICY_WEIGHTS

    out = []
    for tick in range(ticks):
        if weights and 1 <= tick < len(weights):
            gen.put_input(POLICY_WEIGHTS, (tick, iter(list(weights[tick].items()))))
        gen.set_step(tick)
        gen.step()
        out += [r for g in gen.get_output("rollouts") for r in g.rollouts]
    return out


def tool_text(content: str) -> str:
    """What Qwen3's chat template (TRL's training variant, thinking off) writes after a turn that called one tool:
    the result as a user turn, then the next assistant turn's opening."""
    return ("\n<|im_start|>user\n<tool_response>\n" + content + "\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def check_rows(path: str) -> tuple[dict, object]:
    from transformers import AutoModelForCausalLM

    from hfllamarl.runtime.agents.multi_turn import AgentSpec
    from hfllamarl.runtime.training.batching import completion_logprobs, pad_batch
    from hfllamarl.testing.tiny_chat import calculator_rows

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights = versions_of(model, 4)
    agent = AgentSpec(tools=[calculator], max_iterations=2, tool_call_timeout_s=30)
    gen = generator(path, calculator_rows(16, seed=3), agent, schedule=Schedule(2, 5, 5), prompts_per_batch=4,
                    num_generations=4, partial_rollout_tokens=BUDGET)
    rollouts = run_ticks(gen, 7, weights)
    tok = gen.encoder.tokenizer
    batch = pad_batch(rollouts, tok.pad_token_id, "cpu")
    errors, tool_spans_ok, tool_spans = [], True, 0
    for v, w in enumerate(weights):
        model.load_state_dict(w)
        with torch.no_grad():
            pi = completion_logprobs(model, batch, TEMPERATURE)
        for i, r in enumerate(rollouts):
            errors += [abs(pi[i, t].item() - r.behavior_logprobs[t]) for t in r.sampled if r.versions[t] == v]
    mask_ok = all(batch["mask"][i, :len(r.completion_ids)].tolist() == [float(m) for m in r.env_mask]
                  and batch["mask"][i, len(r.completion_ids):].sum() == 0 for i, r in enumerate(rollouts))
    for r in rollouts:
        contents = [m["content"] for m in r.episode.messages if m["role"] == "tool"]
        spans = _spans(r.env_mask, 0)
        tool_spans += len(spans)
        tool_spans_ok &= len(spans) == len(contents) and all(
            tok.decode(r.completion_ids[a:b]) == tool_text(c) for (a, b), c in zip(spans, contents))
        tool_spans_ok &= all(r.versions[t] == r.versions[t - 1] for a, b in spans for t in range(max(a, 1), b))
    called = [r for r in rollouts if r.episode.tool_calls]
    # sampled tokens after the last tool result: the rollout's last turn, which must be its last message (TRL)
    after_tools = [r for r in called if _spans(r.env_mask, 0) and len(r.env_mask) > _spans(r.env_mask, 0)[-1][1]]
    return {
        "last_turn_kept": all(r.episode.messages[-1]["role"] == "assistant" for r in after_tools),
        "cut_after_tools": sum(r.finish_reason == "length" for r in after_tools),
        "rollouts": len(rollouts),
        "with_tool_calls": len(called),
        "tool_spans": tool_spans,
        "tool_spans_ok": bool(tool_spans_ok),
        "mask_ok": bool(mask_ok),
        "sampled_tokens": len(errors),
        "max_error": max(errors),
        "multi_tick": sum(r.segments > 1 for r in rollouts),
        "multi_tick_with_tools": sum(r.segments > 1 and r.episode.tool_calls > 0 for r in rollouts),
        "multi_version_with_tools": sum(len(set(r.versions)) > 1 and r.episode.tool_calls > 0 for r in rollouts),
        "turns_end_with_eos": all(tok.decode(r.completion_ids[a:b]).endswith("<|im_end|>")
                                  for r in called for a, b in _spans(r.env_mask, 1)[:-1]),
        "lengths_ok": all(len(r.completion_ids) <= LENGTH for r in rollouts),
    }, gen.llm


def check_checkpoint(path: str, engine, workdir: str) -> dict:
    from hfllamarl.runtime.weights import checkpoint
    from hfllamarl.runtime.data.episodes import reward_arguments
    from hfllamarl.runtime.agents.multi_turn import AgentSpec
    from hfllamarl.testing.tiny_chat import calculator_rows

    agent = AgentSpec(factories={None: Recorder}, max_iterations=2, tool_call_timeout_s=30)
    kw = dict(schedule=Schedule(1, 5, 5), prompts_per_batch=8, num_generations=2, partial_rollout_tokens=BUDGET)
    # A call turn takes ~32 tokens: some rollouts called the tool in tick 1 and are carried. Now and then (sampled
    # at temperature 1, about 1 batch in 15) all 16 end within 2 ticks and the batch is out before the checkpoint,
    # which then holds nothing to restore: such a batch is sampled again from other rows.
    for attempt in range(6):
        rows = calculator_rows(8, seed=5 + attempt)
        first = generator(path, rows, agent, engine, **kw)
        run_ticks(first, 2)
        carried = [r for f in first.in_flight for r in f.unfinished()]
        if carried:
            break
    before = {id(r): list(r.episode.environment.expressions) for r in carried}
    directory = os.path.join(workdir, "ckpt")
    checkpoint.save_generator_side(first, directory)
    second = generator(path, rows, agent, engine, **kw)
    checkpoint.load_generator_side(second, directory)
    restored = [r for f in second.in_flight for r in f.unfinished()]
    prefixes = [(list(r.completion_ids), list(before.values())[i]) for i, r in enumerate(restored)]
    finished = []
    for tick in range(2, 5):
        second.set_step(tick)
        second.step()
        finished += [r for g in second.get_output("rollouts") for r in g.rollouts]
    by_row = {}
    for r in finished:
        by_row.setdefault(r.row_index, []).append(r)
    envs = reward_arguments(finished)["columns"]["environments"]
    mismatches = [(e.expressions, e.failed, r.episode.tool_calls, r.episode.tool_failures,
                   [m.get("content") for m in r.episode.messages if m["role"] == "tool"])
                  for e, r in zip(envs, finished)
                  if r.episode.tool_calls - len(e.expressions) != r.episode.tool_failures - e.failed]
    return {
        "carried": len(carried),
        "carried_with_calls": sum(bool(v) for v in before.values()),
        "finished": len(finished),
        # Every call counted either reached the environment or failed before it (arguments that do not bind, an
        # unknown tool): calls - reached == failures - failures inside the environment, and nothing runs twice.
        "env_calls_match": not mismatches,
        "mismatches": mismatches,
        "reward_counts_calls": all(r.model_rewards["Recorder"] == float(len(e.expressions))
                                   for e, r in zip(envs, finished)),
        "kept_earlier_calls": all(any(r.completion_ids[:len(ids)] == ids and e.expressions[:len(calls)] == calls
                                      for r, e in zip(finished, envs)) for ids, calls in prefixes),
    }


def check_evaluation(path: str, engine) -> dict:
    """Evaluation during training with tools: every eval prompt's rollouts run to the end in the tick, multi-turn."""
    from datasets import Dataset

    from hfllamarl.runtime.agents.multi_turn import AgentSpec
    from hfllamarl.testing.tiny_chat import calculator_rows

    from safetensors.torch import load_file

    from hfllamarl.runtime.loop.weights_channel import POLICY_WEIGHTS

    agent = AgentSpec(tools=[calculator], max_iterations=2, tool_call_timeout_s=30)
    # The warmed-up model, which calls the tool in about half its answers (the engine still holds the noisy version 4
    # of `rows`, which may call it in none of 18).
    gen = generator(path, calculator_rows(8, seed=9), agent, engine, schedule=Schedule(1, 1), prompts_per_batch=8,
                    num_generations=2, partial_rollout_tokens=BUDGET, num_generations_eval=3)
    gen.put_input(POLICY_WEIGHTS, (0, iter(load_file(os.path.join(path, "model.safetensors")).items())))
    # 12 prompts: the engine's random stream here depends on how the checks before went, and 6 prompts x 3 rollouts
    # (each prompt's three alike) drew no tool call at all in a few CI runs.
    gen.eval_dataset = Dataset.from_list(calculator_rows(12, seed=11))
    groups = gen.agent._evaluation()
    rollouts = [r for g in groups for r in g.rollouts]
    return {"groups": len(groups), "rollouts": len(rollouts), "eval_versions": sorted({g.eval_version for g in groups}),
            "all_finished": all(r.finish_reason in ("stop", "length") for r in rollouts),
            "with_tool_calls": sum(bool(r.episode.tool_calls) for r in rollouts),
            "masks_ok": all(len(r.env_mask) == len(r.completion_ids) for r in rollouts)}


def check_hang(path: str, engine) -> dict:
    """A calculator whose odd calls hang and even calls raise, 1 s per call: batches of 8 prompts x 2 until it was
    called twice (how often the tiny model calls a tool varies with its build; at most 6 batches)."""
    from hfllamarl.runtime.agents.multi_turn import AgentSpec
    from hfllamarl.testing.tiny_chat import calculator_rows

    agent = AgentSpec(tools=[stuck_calculator], max_iterations=2, tool_call_timeout_s=1.0)
    start, rollouts, batches, abandoned = time.perf_counter(), [], 0, 0
    while batches < 6 and CALLS["n"] < 2:
        gen = generator(path, calculator_rows(8, seed=7 + batches), agent, engine, length=200,
                        schedule=Schedule(1, 0), prompts_per_batch=8, num_generations=2)
        rollouts += run_ticks(gen, 1)
        abandoned += gen.agent.runner.abandoned
        batches += 1
    errors = [m["content"] for r in rollouts for m in r.episode.messages if m["role"] == "tool"]
    return {
        "batches": batches,
        "finished": len(rollouts),
        "calls": sum(r.episode.tool_calls for r in rollouts),
        "failures": sum(r.episode.tool_failures for r in rollouts),
        "timeouts": sum(r.episode.tool_timeouts for r in rollouts),
        "errors_seen": sorted({"abandoned" if "abandoned" in e else e for e in errors}),
        "seconds": time.perf_counter() - start,
        "abandoned": abandoned,
    }


def _spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    spans, start = [], None
    for t, m in enumerate(list(mask) + [1 - value]):
        if m == value and start is None:
            start = t
        elif m != value and start is not None:
            spans.append((start, t))
            start = None
    return spans


def main(path: str, workdir: str) -> None:
    rows, engine = check_rows(path)
    # The evaluation samples before the hang check: that one runs a timing-dependent number of batches on the
    # engine, which would move the engine's random stream under the evaluation's rollouts.
    result = {"rows": rows, "checkpoint": check_checkpoint(path, engine, workdir),
              "evaluation": check_evaluation(path, engine), "hang": check_hang(path, engine)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    os._exit(0)  # abandoned tool threads must not hold the interpreter
