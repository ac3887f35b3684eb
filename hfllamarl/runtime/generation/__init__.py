"""The generator side: the executor that samples rollouts (generator), its child-process entry
(generator_child), the vLLM engine (engine), which part of each weight a rank reads (loader_regions), and the
checks before an engine starts (preflight). Imports the layers below it, never `training`."""
