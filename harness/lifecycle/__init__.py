"""The run lifecycle: the run directory's artifacts and metric keys, checkpoints and resume, the run
lock, signals, divergence, memory accounting and the trackers (W&B)."""
