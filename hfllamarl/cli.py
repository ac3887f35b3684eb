"""The `hfllamarl` command.

    hfllamarl plugins list      every installed plugin: group, name, distribution, version (nothing imported)
    hfllamarl eval ...          generate with vLLM on a JSONL data set and score with a reward (hfllamarl.commands.evaluate)
    hfllamarl bench weight-sync ...   time the weight-sync backends side by side (hfllamarl.commands.bench_weight_sync)
    hfllamarl bench learning ...      learning vs staleness on the demo task (hfllamarl.commands.bench_learning)
    hfllamarl bench profile ...       measure decode-step and training-token times for plan --profile (hfllamarl.commands.bench_profile)
    hfllamarl bench load ...          each trainer rank's memory while loading the policy, sharded vs whole (hfllamarl.commands.bench_load)
    hfllamarl bench vs-trl ...        TRL's GRPOTrainer and AsyncAIPOTrainer on the same job, timed (hfllamarl.commands.bench_vs_trl)
    hfllamarl bench lora-sync ...     LoRA's weight sync: the adapters alone vs the adapted layers merged (hfllamarl.commands.bench_lora_sync)
    hfllamarl bench grader ...        math_sympy against graders' test suites, Math-Verify side by side (hfllamarl.commands.bench_grader)
    hfllamarl bench multi-turn ...    multi-turn tool calling, synchronous vs asynchronous throughput (hfllamarl.commands.bench_multi_turn)
    hfllamarl bench replica-quorum ...  a step of 2 trainer replica groups: today's layout vs torchft's quorum (hfllamarl.commands.bench_replica_quorum)
    hfllamarl bench replica-groups ...  a training run in 2 trainer replica groups vs today's hybrid sharding (hfllamarl.commands.bench_replica_groups)
    hfllamarl train --config recipe.yaml [--field value ...]   train from a recipe, as `trl grpo --config` (hfllamarl.commands.train)
    hfllamarl preload [--socket PATH]   keep a preloaded process server for the single-process jobs of this shell (hfllamarl.commands.preload)
    hfllamarl plan ...          recommend a trainer/generator GPU split from the memory and step-time model (hfllamarl.commands.plan)
    hfllamarl version
"""

from __future__ import annotations

import argparse
import sys


def _plugins_list(args) -> int:
    from .registry import list_plugins

    rows = list_plugins()
    header = ("group", "name", "distribution", "version", "entry point")
    table = [header] + [(r["group"], r["name"], r["distribution"], r["version"], r["value"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


class _BothCases(argparse.ArgumentParser):
    """Options written `--kebab-case` also answer to `--snake_case`, as `hfllamarl train` (TRL's field names) does:
    one spelling works everywhere."""

    def add_argument(self, *names, **kwargs):
        return super().add_argument(*names, *_snake(names), **kwargs)

    def add_mutually_exclusive_group(self, **kwargs):
        group = super().add_mutually_exclusive_group(**kwargs)
        add = group.add_argument
        group.add_argument = lambda *names, **kw: add(*names, *_snake(names), **kw)
        return group


def _snake(names) -> list[str]:
    return [f"--{n[2:].replace('-', '_')}" for n in names
            if n.startswith("--") and "-" in n[2:] and f"--{n[2:].replace('-', '_')}" not in names]


def _command(parent, name: str, help: str, module) -> None:
    """A sub-command served by a module with `add_arguments(parser)` and `run(args)`."""
    parser = parent.add_parser(name, help=help)
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hfllamarl", description="Asynchronous off-policy RL fine-tuning of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_BothCases)
    plugins_parser = sub.add_parser("plugins", help="installed plugins (`hfllamarl plugins` alone: list them)")
    plugins_parser.set_defaults(func=_plugins_list)
    plugins = plugins_parser.add_subparsers(dest="action")
    plugins.add_parser("list", help="list every installed plugin").set_defaults(func=_plugins_list)
    # light modules: heavy imports happen inside their run()
    from .commands import (bench_grader, bench_learning, bench_load, bench_lora_sync, bench_multi_turn, bench_profile,
                           bench_replica_groups, bench_replica_quorum, bench_vs_trl, evaluate, plan, preload,
                           train)
    from .commands import bench_weight_sync as bench

    _command(sub, "eval", "generate on a JSONL data set and score it", evaluate)
    bench_parser = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    ws = bench_parser.add_parser("weight-sync", help="nccl_ddma vs broadcast vs disk, side by side")
    bench.add_weight_sync_arguments(ws)
    ws.set_defaults(func=bench.run_weight_sync)
    _command(bench_parser, "learning", "the staleness study: losses x corrections x staleness, over seeds, with intervals",
             bench_learning)
    _command(bench_parser, "profile", "measure decode-step and training-token times for plan --profile",
             bench_profile)
    _command(bench_parser, "load", "each trainer rank's memory while loading the policy, sharded vs whole", bench_load)
    _command(bench_parser, "vs-trl", "TRL's GRPOTrainer and AsyncAIPOTrainer on the same job, timed", bench_vs_trl)
    _command(bench_parser, "lora-sync", "LoRA's weight sync: the adapters alone vs the adapted layers merged",
             bench_lora_sync)
    _command(bench_parser, "grader", "math_sympy against graders' test suites, Math-Verify side by side", bench_grader)
    _command(bench_parser, "multi-turn", "multi-turn tool calling: synchronous vs asynchronous throughput",
             bench_multi_turn)
    _command(bench_parser, "replica-quorum", "a step of 2 trainer replica groups: today's layout vs torchft's quorum",
             bench_replica_quorum)
    _command(bench_parser, "replica-groups", "a training run in 2 trainer replica groups vs today's hybrid sharding",
             bench_replica_groups)
    _command(sub, "preload", "keep a server that forks the generator processes of single-process jobs", preload)
    _command(sub, "plan", "recommend a trainer/generator GPU split (LlamaRL section 6 model)", plan)
    # every argument after `train` is the recipe's: TrlParser reads them (and answers --help)
    sub.add_parser("train", help="train from a recipe (YAML and/or flags); --check validates it", add_help=False,
                   usage="hfllamarl train --config RECIPE.yaml [--check] [--FIELD VALUE ...]",
                   description="Every AsyncAIPOConfig field, the model's (TRL's ModelConfig) and the recipe's own "
                               "fields (data set, prompt, rewards, tools, prepare), from a YAML file and/or flags "
                               "(flags win); `hfllamarl train --help` lists them all, the recipes guide explains "
                               "them.").set_defaults(func=train.run, takes_rest=True)
    sub.add_parser("version", help="print the version").set_defaults(
        func=lambda a: print(__import__("hfllamarl").__version__) or 0)
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
