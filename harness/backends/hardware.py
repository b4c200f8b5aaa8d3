"""hardware=auto: pick the preset matching the visible GPU (or cpu); a named preset must be present."""

from __future__ import annotations

import torch

from harness import recipes
from harness.config.schema import HardwareConfig

# substrings of torch.cuda.get_device_name(), most specific first
_GPU_PRESETS = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def preset_for_name(device_name: str) -> str:
    """The hardware preset a CUDA device name (torch.cuda.get_device_name()) picks, or "unknown_gpu"."""
    name = device_name.upper()
    return next((preset for key, preset in _GPU_PRESETS if key in name), "unknown_gpu")


def detect_preset() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return preset_for_name(torch.cuda.get_device_name())


def resolve_hardware(hw: HardwareConfig) -> HardwareConfig:
    """Replace hardware=auto by the detected preset; an unknown GPU gets its capability and no peak."""
    if hw.name != "auto":
        return hw
    from harness.config.store import load_preset

    preset = detect_preset()
    if preset != "unknown_gpu":
        return load_preset("hardware", preset)
    major, minor = torch.cuda.get_device_capability()
    cc = major + minor / 10
    native = recipes.native_on(cc)
    return HardwareConfig(
        name=torch.cuda.get_device_name(),
        compute_capability=cc,
        native_recipes=native,
    )


def device_for(hw: HardwareConfig) -> torch.device:
    """cuda for a GPU preset, cpu for cpu; a GPU preset on a machine without CUDA is an error."""
    if hw.name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"hardware={hw.name} but this machine has no CUDA device: use hardware=auto or "
            "hardware=cpu (recipes are then emulated)"
        )
    return torch.device("cuda")
