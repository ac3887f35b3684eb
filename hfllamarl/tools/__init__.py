"""Tools around the runtime: benchmarks, the planner, evaluation, the tiny demo model."""
