"""The runtime: what every process of a job runs (topology, channels, the controller, the executors, weight sync,
checkpoints, rollouts, rewards). Heavy imports (vllm, accelerate) stay inside functions."""
