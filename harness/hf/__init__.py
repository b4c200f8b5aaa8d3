"""Hugging Face interop: configs in (config.py), safetensors weights in and out (weights.py)."""
