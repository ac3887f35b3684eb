"""Built-in algorithms: advantage estimation and loss over per-token log-probs."""
