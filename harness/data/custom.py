"""data=custom: a user's own source, named by `data._target_`, without editing lowp.

    python -m harness.train data=custom data._target_=mypkg.data.MySource data.params.path=/x

`_target_` is the import path of a callable (a TokenData subclass, or a function returning one)
called as `target(vocab_size=..., seq_length=..., **data.params)`, as Hydra's `instantiate` calls a
`_target_`. What it returns is checked like a built-in source: a TokenData of this sequence length
with a vocabulary and a fingerprint of its content (the resume check compares it), and then, as
for every source, one train batch and the eval set are built before any job starts. The run's
fingerprint also hashes the target and its params, so two sources that report the same content
under different code are not mistaken for one another. A ValueError the source raises is the
user's input: one `error:` line, exit code 2. docs/data.md has a complete example.
"""

from __future__ import annotations

import importlib

from harness.config.schema import DataConfig
from harness.data.base import TokenData, config_error, fingerprint


def import_target(path: str):
    """`pkg.mod.Name` or `pkg.mod:Name`, the object it names."""
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    option = f"data._target_={path}"
    if not module or not attr:
        raise config_error(option, "not an import path", "give package.module.Name")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise config_error(
            option, f"cannot import {module} ({exc})", "put it on PYTHONPATH or install it"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise config_error(option, f"{module} has no {attr}", "check the name")
        obj = getattr(obj, part)
    if not callable(obj):
        raise config_error(
            option, f"{attr} is not callable", "name a TokenData class or a function returning one"
        )
    return obj


def build(cfg: DataConfig, vocab_size: int, seq_length: int) -> TokenData:
    if not cfg._target_:
        raise config_error(
            "data._target_=null", "data=custom needs a source", "set data._target_=pkg.mod.MySource"
        )
    target = import_target(cfg._target_)
    option = f"data._target_={cfg._target_}"
    try:
        data = target(vocab_size=vocab_size, seq_length=seq_length, **cfg.params)
    except TypeError as exc:  # a parameter it does not take, or one it needs that is missing
        raise config_error(option, f"rejected its arguments ({exc})", "check data.params") from None
    if not isinstance(data, TokenData):
        raise config_error(
            option, f"returned {type(data).__name__}, not a TokenData", "return a harness.data.TokenData"
        )
    if data.seq_length != seq_length:
        raise config_error(
            option,
            f"built seq_length {data.seq_length}, the model's is {seq_length}",
            "use the seq_length it is given",
        )
    if not (isinstance(data.vocab_size, int) and data.vocab_size >= 1):
        raise config_error(option, f"vocab_size={data.vocab_size!r}", "give the source a vocabulary >= 1")
    if not (isinstance(data.fingerprint, str) and data.fingerprint):
        raise config_error(option, "has no fingerprint", "set fingerprint to a hash of the source's content")
    source = data.fingerprint
    data.fingerprint = fingerprint({"target": cfg._target_, "params": cfg.params, "source": source})
    data.facts.update(target=cfg._target_, params=dict(cfg.params), source_fingerprint=source)
    return data
