"""The runtime: what every process of a job runs, in subpackages by role, each importing only those listed before it
(the bottom layer first):

    world       process layout, liveness, child processes
    loop        schedule, channels, executors, the controller, dispatch, the weights channel
    weights     FSDP2 shards, loading, LoRA, export, checkpoints
    data        prompts, rewards, reward models, episodes
    agents      multi-turn rollouts, tools, environments
    generation  the generator executor and its vLLM engine
    training    the trainer executor, packing, metrics, logging

Nothing here is a public interface: plugins use `hfllamarl.contracts`, `hfllamarl.losses`,
`hfllamarl.weight_sync` and `hfllamarl.sandbox`. Heavy imports (vllm, accelerate) stay inside functions."""
