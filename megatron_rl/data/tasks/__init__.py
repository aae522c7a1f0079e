"""Built-in synthetic tasks a tiny model learns on a CPU, generated from a seed (no downloads)."""
