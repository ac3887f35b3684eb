"""Built-in reward functions with TRL's reward-function contract."""
