"""Data parallelism: the process group and launch environment (process.py), how the model and
optimizer are spread over the ranks (strategies.py), and what the ranks agree on (agree.py)."""
