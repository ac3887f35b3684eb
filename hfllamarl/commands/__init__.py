"""The `hfllamarl` command's sub-commands: benchmarks, the planner, evaluation. Never imported by the runtime."""
