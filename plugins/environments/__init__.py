"""Built-in environments with TRL's `environment_factory` contract (entry-point group `hfllamarl.environments`)."""
