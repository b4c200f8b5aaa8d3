"""Interop with Megatron-LM and Hugging Face: the Megatron command a config maps to
(megatron.py, megatron_arch.py), Hugging Face configs and safetensors in (hf_config.py, hf_weights.py)
and out (export.py)."""
