"""Sweeps: named sweep files expanded into jobs (spec.py), launched through Hydra's multirun with
lowp's launcher (launch.py), validated before any job starts (callbacks.py), watched (progress.py)."""
