"""Prompts (the one prompt builder), rewards (the one reward path), reward models, and episodes (a multi-turn
completion as messages). Imports `world`, `loop` and `weights`."""
