"""Built-in weight-sync backends."""
