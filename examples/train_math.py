"""Train a policy on MATH or GSM8K with asynchronous AIPO: the GPU-cluster script.

Every setting lives in a recipe file (TRL's `--config` YAML: `AsyncAIPOConfig` fields plus the script's
own fields below); any field can be overridden on the command line (`--learning_rate 5e-7`).

    # 1 node x 8 GPUs: 6 FSDP2 trainer ranks + 2 generator ranks (one vLLM engine, tensor-parallel 2)
    bash examples/launch/1node_8gpu.sh
    # 2 nodes x 8 GPUs: node 0 trains, node 1 generates (vLLM tensor-parallel 8, fp8)
    MACHINE_RANK=0 MAIN_IP=10.0.0.1 bash examples/launch/2node_16gpu.sh   # on node 0
    MACHINE_RANK=1 MAIN_IP=10.0.0.1 bash examples/launch/2node_16gpu.sh   # on node 1

    # check a recipe on any machine (no GPU needed, nothing is loaded or started):
    python examples/train_math.py --config examples/recipes/llama8b_1node_8gpu.yaml --check
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from trl import TrlParser

from hfllamarl import AsyncAIPOConfig

# The column holding the question, and the reward that scores it, for each supported data set.
QUESTION = {"math": "problem", "gsm8k": "question"}
REWARD = {"math": "math_sympy", "gsm8k": "gsm8k"}
INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="", metadata={"help": "Local directory (or hub id) of the policy."})
    dataset_path: str = field(default="", metadata={"help": "A JSONL file: MATH rows (problem, solution) or "
                                                             "GSM8K rows (question, answer)."})
    dataset_kind: str = field(default="math", metadata={"help": "'math' or 'gsm8k'."})
    reward_funcs: list[str] = field(default_factory=list, metadata={"help": "Reward plugins (default: the data "
                                                                             "set's own: math_sympy or gsm8k)."})
    chat: bool = field(default=True, metadata={"help": "Prompts as chat messages (the tokenizer's chat template); "
                                                        "false: plain text."})
    num_processes: int = field(default=0, metadata={"help": "Processes the launcher starts over all nodes; "
                                                             "`--check` verifies the layout against it."})
    check: bool = field(default=False, metadata={"help": "Validate the recipe and exit."})


def to_prompts(dataset, kind: str, chat: bool = True):
    """Conversational prompts (TRL's format) or plain text; the other columns reach the reward functions."""
    question = QUESTION[kind]
    if not chat:
        return dataset.map(lambda row: {"prompt": f"{row[question]}\n\n{INSTRUCTION}\n"})
    return dataset.map(lambda row: {"prompt": [{"role": "user", "content": f"{row[question]}\n\n{INSTRUCTION}"}]})


def check(script: ScriptArguments, config: AsyncAIPOConfig) -> None:
    """What can be checked without the cluster: the layout, the batch arithmetic, the data kind."""
    if script.dataset_kind not in QUESTION:
        raise SystemExit(f"dataset_kind must be one of {sorted(QUESTION)}, not {script.dataset_kind!r}")
    n, g = script.num_processes, config.num_generator_processes
    if n and n <= g:
        raise SystemExit(f"num_processes={n} leaves no trainer rank beside {g} generator ranks")
    trainers = (n - g) if n else None
    per_step = (config.per_device_train_batch_size * config.gradient_accumulation_steps * trainers) if n else None
    print(f"recipe OK: {n or '?'} processes = {trainers or '?'} trainer + {g} generator ranks "
          f"({config.num_generator_replicas} vLLM replica(s) of tensor-parallel {config.generator_tensor_parallel_size}, "
          f"quantization "
          f"{config.generator_quantization or 'none'}); {per_step or '?'} completions per step, "
          f"{config.num_generations} per prompt; staleness <= {config.max_staleness}; algorithm {config.algorithm}")


def main(argv=None):
    parser = TrlParser((ScriptArguments, AsyncAIPOConfig))
    script, config = parser.parse_args_and_config(argv)
    if script.check:
        check(script, config)
        return
    from datasets import load_dataset

    from hfllamarl import AsyncAIPOTrainer

    dataset = to_prompts(load_dataset("json", data_files=script.dataset_path, split="train"), script.dataset_kind,
                         script.chat)
    trainer = AsyncAIPOTrainer(model=script.model_name_or_path, args=config, train_dataset=dataset,
                               reward_funcs=script.reward_funcs or REWARD[script.dataset_kind])
    trainer.train(resume_from_checkpoint=True if config.resume_from_checkpoint == "true" else
                  config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)


if __name__ == "__main__":
    sys.exit(main())
