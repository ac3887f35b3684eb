"""Built-in reward functions (TRL reward-function contract), registered as ``hfllamarl.rewards`` entry points."""
