"""Training, the composition root: the loop (`trainer.Trainer`) and one run in its run directory
(`job.run`); `python -m harness.train` is its command line."""
