"""User scripts with TRL's agentic arguments: each trains under TRL's GRPOTrainer (`--trl`) and AsyncAIPOTrainer,
the class names swapped and nothing else.

    python tests/scripts/agentic_user.py tools|env|rollout_func MODEL_DIR OUTPUT_DIR [--trl] [--steps 3]
        [--max-staleness 1] [--partial N] [--batch 4] [--generators 1] [--tp N] [--hang] [--timeout S] [--summary FILE]
        [--calls FILE]

- `tools`: `tools=[calculator]`, a reward reading the last assistant message and `answer`;
- `env`: `environment_factory=CalculatorEnv` (state per rollout, `reset` adds to the prompt, `get_reward`), and a
  reward function reading `environments`;
- `rollout_func`: a rollout function generating with `trainer.vllm_generation.generate` (AsyncAIPOTrainer only:
  TRL's needs use_vllm=True, which needs a GPU build of vLLM).

The model is hfllamarl's tiny Qwen3-template model (`build_tiny_model(..., chat_template="qwen3")`). `--hang`: the
calculator never returns on its 1st call (and every 3rd after) and raises on its 2nd (likewise). `--surrogate`: its
results end in a lone surrogate, as model code's `print(chr(0xd800))` does. `--summary` writes
what the reward function received, one JSON line per call; `--calls` appends one line per tool call (pid,
expression, whether it raised).
"""

import argparse
import json
import os
import time

from datasets import Dataset

from hfllamarl.testing.tiny_chat import calculator_rows

OPTIONS = {"hang": False, "calls": None, "count": 0, "surrogate": False}
SUMMARY = []


def _evaluate(expression: str) -> str:
    from hfllamarl.plugins.environments.calculator import evaluate

    failed = True
    try:
        OPTIONS["count"] += 1
        if OPTIONS["hang"] and OPTIONS["count"] % 3 == 1:
            time.sleep(3600)  # a tool that never returns
        if OPTIONS["hang"] and OPTIONS["count"] % 3 == 2:
            raise RuntimeError("the calculator is broken today")
        result, failed = evaluate(expression), False
        return result + chr(0xD800) if OPTIONS["surrogate"] else result  # (what print(chr(0xd800)) gives back)
    finally:  # (a call that raised is one the tool ran: the job counts it as failed)
        if OPTIONS["calls"]:
            with open(OPTIONS["calls"], "a") as fh:
                fh.write(json.dumps({"pid": os.getpid(), "expression": expression, "failed": failed}) + "\n")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12+30".
    """
    return _evaluate(expression)


class CalculatorEnv:
    """One per rollout: remembers the expressions it evaluated and scores itself by them."""

    def __init__(self):
        self.expressions, self.answer = [], None

    def reset(self, **row):
        self.expressions, self.answer = [], row.get("answer")
        return " Use the calculator."

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "12+30".
        """
        self.expressions.append(expression)
        return _evaluate(expression)

    def get_reward(self) -> float:
        return 0.5 if self.expressions else 0.0


def boxed_answer(prompts, completions, answer, **kwargs):
    """1 when the last assistant message boxes the answer; records what it was given."""
    out = []
    for messages, gold in zip(completions, answer):
        text = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        out.append(1.0 if f"\\boxed{{{gold}}}" in text else 0.0)
    envs = kwargs.get("environments")
    SUMMARY.append({"kwargs": sorted(kwargs), "roles": [[m["role"] for m in c] for c in completions],
                    "tool_contents": [m["content"] for c in completions for m in c if m["role"] == "tool"],
                    "prompt_ends": [p[-1]["content"][-20:] for p in prompts], "n": len(completions),
                    "environments": [[type(e).__name__, list(e.expressions)] for e in envs] if envs else None,
                    "extra": kwargs.get("turns")})
    return out


def used_the_tool(environments, **kwargs):
    """TRL passes each rollout's environment: 1 when it evaluated something."""
    return [float(bool(e.expressions)) for e in environments]


def rollout_func(prompts, trainer):
    """A hand-written loop: one completion per prompt (TRL repeats each prompt num_generations times)."""
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer.apply_chat_template(p, tools=[calculator], add_generation_prompt=True, tokenize=True,
                                                return_dict=False, **trainer.chat_template_kwargs) for p in prompts]
    ids, completions, logprobs, _ = trainer.vllm_generation.generate(prompt_ids, images=None, num_generations=1)
    return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[lp[0] for lp in seq] for seq in logprobs],
            "env_mask": [[1] * len(c) for c in completions], "turns": [1] * len(completions)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["tools", "env", "rollout_func"])
    p.add_argument("model")
    p.add_argument("output_dir")
    p.add_argument("--trl", action="store_true", help="train with TRL's GRPOTrainer instead")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--partial", type=int, default=None, help="partial_rollout_tokens")
    p.add_argument("--generators", type=int, default=1, help="num_generator_processes")
    p.add_argument("--tp", type=int, default=None, help="generator_tensor_parallel_size (default: all generators)")
    p.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--hang", action="store_true")
    p.add_argument("--surrogate", action="store_true", help="the calculator's results end in a lone surrogate")
    p.add_argument("--timeout", type=float, default=60.0, help="tool_call_timeout_s")
    p.add_argument("--summary", default=None)
    p.add_argument("--calls", default=None)
    args = p.parse_args()
    OPTIONS.update(hang=args.hang, calls=args.calls, surrogate=args.surrogate)
    if args.trl:
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer

        extra = dict(use_vllm=False, bf16=False, use_cpu=True)
    else:
        from hfllamarl import AsyncAIPOConfig as Config, AsyncAIPOTrainer as Trainer

        extra = dict(max_staleness=args.max_staleness, tool_call_timeout_s=args.timeout,
                     partial_rollout_tokens=args.partial, num_generator_processes=args.generators,
                     generator_tensor_parallel_size=args.tp)
    if args.mode != "rollout_func":
        extra["max_tool_calling_iterations"] = 2
    config = Config(output_dir=args.output_dir, per_device_train_batch_size=args.batch, num_generations=2,
                    max_completion_length=96, max_steps=args.steps, learning_rate=1e-3, logging_steps=1,
                    report_to="none", save_strategy="no", chat_template_kwargs={"enable_thinking": False},
                    seed=0, **extra)
    dataset = Dataset.from_list(calculator_rows(32, seed=0))
    if args.mode == "tools":
        trainer = Trainer(model=args.model, reward_funcs=[boxed_answer], args=config, train_dataset=dataset,
                          tools=[calculator])
    elif args.mode == "env":
        trainer = Trainer(model=args.model, reward_funcs=[boxed_answer, used_the_tool], args=config,
                          train_dataset=dataset, environment_factory=CalculatorEnv)
    else:
        trainer = Trainer(model=args.model, reward_funcs=[boxed_answer], args=config, train_dataset=dataset,
                          rollout_func=rollout_func)
    trainer.train()
    if trainer.state is not None:
        print("LOG_HISTORY " + json.dumps(trainer.state.log_history), flush=True)
    if args.summary and SUMMARY:
        with open(args.summary, "w") as fh:
            for row in SUMMARY:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
