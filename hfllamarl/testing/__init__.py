"""Tiny models of real families built locally (random init, a locally trained tokenizer), for tests, demos and
benchmarks: no model hub needed."""
