"""The checkpoint format (harness.lifecycle.checkpoint): round trip, atomicity, retention, corruption,
safety."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from harness.lifecycle import checkpoint as C
from tests.faults import tmpfs


def tree():
    gen = torch.Generator().manual_seed(3)
    return {
        "model": {"wte.weight": torch.randn(5, 3), "ln.bias": torch.zeros(3, dtype=torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(2)}}, "groups": [1e-3]},
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "gen": gen.get_state()},
        "codes": torch.arange(6, dtype=torch.uint8),
        "none": None,
        "pair": (1, "a"),
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_round_trip_restores_every_leaf_and_type(tmp_path):
    t = tree()
    C.save(tmp_path, 7, t, keep=2)
    path, step, back = C.load_latest(tmp_path)
    assert step == 7 and path.name == "step_00000007"
    assert same(t, back)
    random.setstate(back["rng"]["python"])  # the restored states are usable as they are
    np.random.set_state(back["rng"]["numpy"])
    torch.Generator().set_state(back["rng"]["gen"])


def test_keeps_the_newest_k(tmp_path):
    for step in (2, 4, 6, 8):
        C.save(tmp_path, step, {"x": torch.tensor([step])}, keep=2)
    assert [p.name for p in C.candidates(tmp_path)] == ["step_00000008", "step_00000006"]


def test_full_disk_leaves_previous_checkpoint_and_no_partial_one(tmp_path):
    """A real full disk (a tmpfs with room for one checkpoint): DCP's CheckpointException is
    unwrapped into a CheckpointError naming the path, the cause and the fix."""
    big = {"x": torch.zeros(64 * 1024)}  # 256 KiB
    with tmpfs(tmp_path / "run", 400_000) as run_dir:
        C.save(run_dir, 2, big, keep=3)
        with pytest.raises(C.CheckpointError) as err:
            C.save(run_dir, 4, {"x": torch.ones(64 * 1024)}, keep=3)
        assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]
        assert C.load_latest(run_dir)[1] == 2
    message = str(err.value)
    assert "cannot write checkpoint 4" in message and str(run_dir / "checkpoints") in message
    assert "No space left on device (the disk is full); free space there" in message


def test_a_corrupted_checkpoint_does_not_count_toward_keep(tmp_path):
    C.save(tmp_path, 2, {"x": torch.tensor([2.0])}, keep=2)
    newest = C.save(tmp_path, 4, {"x": torch.tensor([4.0])}, keep=2)
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-3])
    C.save(tmp_path, 6, {"x": torch.tensor([6.0])}, keep=2)
    # two usable ones are kept (6 and 2); the corrupted 4 stays until it is older than both
    assert [p.name for p in C.candidates(tmp_path)] == ["step_00000006", "step_00000004", "step_00000002"]
    C.save(tmp_path, 8, {"x": torch.tensor([8.0])}, keep=2)
    assert [p.name for p in C.candidates(tmp_path)] == ["step_00000008", "step_00000006"]


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "no_manifest", "bad_state"])
def test_corrupted_newest_falls_back_to_previous_with_warning(tmp_path, damage):
    C.save(tmp_path, 2, {"x": torch.tensor([2.0])}, keep=3)
    newest = C.save(tmp_path, 4, {"x": torch.tensor([4.0])}, keep=3)
    data = next(newest.glob("*.distcp"))
    if damage == "flip_byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:10])
    elif damage == "no_manifest":
        (newest / C.MANIFEST).unlink()
    else:
        (newest / C.STATE).write_text("{")
    with pytest.warns(RuntimeWarning, match="step_00000004 is unusable.*falling back"):
        path, step, back = C.load_latest(tmp_path)
    assert step == 2 and torch.equal(back["x"], torch.tensor([2.0]))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    """A tampered .metadata naming a callable (os.system) is not unpickled, even with a valid manifest."""
    path = C.save(tmp_path, 2, {"x": torch.tensor([2.0])}, keep=1)

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        C._dcp_load(path)
    assert not (tmp_path / "pwned").exists()


def test_no_checkpoint_is_none(tmp_path):
    assert C.load_latest(tmp_path) is None
    (tmp_path / "checkpoints" / ".tmp-step_00000002-1").mkdir(parents=True)  # a dead writer's leftovers
    assert C.load_latest(tmp_path) is None


def test_unstorable_leaf_names_its_path(tmp_path):
    with pytest.raises(TypeError, match="model.f: cannot store a function"):
        C.save(tmp_path, 1, {"model": {"f": lambda: 0}}, keep=1)


def test_te_parameter_names_map_back_to_the_canonical_ones():
    """Checkpoints name TEGPT's parameters like the emulated GPT's (the te.TransformerLayer names
    written down from TE 2.20.2's sources: fuse_qkv_params=True, LayerNormMLP)."""
    from harness.backends.te_names import canonical_name, te_name

    pairs = {
        "blocks.0.ln1.weight": "blocks.0.layer.self_attention.layernorm_qkv.layer_norm_weight",
        "blocks.0.ln1.bias": "blocks.0.layer.self_attention.layernorm_qkv.layer_norm_bias",
        "blocks.0.attn.qkv.weight": "blocks.0.layer.self_attention.layernorm_qkv.weight",
        "blocks.1.attn.proj.bias": "blocks.1.layer.self_attention.proj.bias",
        "blocks.1.ln2.weight": "blocks.1.layer.layernorm_mlp.layer_norm_weight",
        "blocks.1.mlp.fc1.weight": "blocks.1.layer.layernorm_mlp.fc1_weight",
        "blocks.1.mlp.fc2.bias": "blocks.1.layer.layernorm_mlp.fc2_bias",
        "wte.weight": "wte.weight",
        "lm_head.weight": "lm_head.weight",
    }
    for canonical, te in pairs.items():
        assert te_name(canonical) == te and canonical_name(te) == canonical
    with pytest.raises(KeyError):
        canonical_name("blocks.0.layer.self_attention.core_attention.weight")


def test_moe_block_names_map_to_te_and_back():
    """An MoE block on TE (harness.backends.te_moe) holds its norm as `layernorm_mlp.norm` and its MoE
    layer, under the emulated model's names, as `layernorm_mlp.moe`; dense blocks of the same model
    keep LayerNormMLP's names. Every tensor of an emulated model with a dense block, a shared expert and
    its gate and the expert bias maps to one TE name and back."""
    from harness.backends import build_backend
    from harness.backends.te_names import canonical_name, te_names
    from harness.train import backend_spec
    from tests.helpers import compose_cfg

    over = ["model=qwen3_moe_tiny", "hardware=cpu", "model.moe_layer_freq=[0,1]"]
    over += ["model.moe_shared_expert_intermediate_size=32", "model.moe_shared_expert_gate=true"]
    over += ["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true"]
    cfg = compose_cfg(*over)
    model = build_backend(backend_spec(cfg), torch.device("cpu")).build_model()
    names = te_names(model.state_dict())
    assert {canonical_name(t) for t in names.values()} == set(names)
    assert len(set(names.values())) == len(names)
    want = {
        "blocks.0.ln2.weight": "blocks.0.layer.layernorm_mlp.layer_norm_weight",
        "blocks.0.mlp.fc1.weight": "blocks.0.layer.layernorm_mlp.fc1_weight",
        "blocks.1.ln2.weight": "blocks.1.layer.layernorm_mlp.norm.weight",
        "blocks.1.mlp.router.weight": "blocks.1.layer.layernorm_mlp.moe.router.weight",
        "blocks.1.mlp.router.expert_bias": "blocks.1.layer.layernorm_mlp.moe.router.expert_bias",
        "blocks.1.mlp.experts.fc1.weight": "blocks.1.layer.layernorm_mlp.moe.experts.fc1.weight",
        "blocks.1.mlp.shared_experts.fc2.weight": (
            "blocks.1.layer.layernorm_mlp.moe.shared_experts.fc2.weight"
        ),
        "blocks.1.mlp.shared_experts_gate": "blocks.1.layer.layernorm_mlp.moe.shared_experts_gate",
        "blocks.1.attn.qkv.weight": "blocks.1.layer.self_attention.layernorm_qkv.weight",
    }
    assert {k: names[k] for k in want} == want
