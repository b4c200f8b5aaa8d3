"""data=blend: Megatron's `w1 p1 w2 p2` blends in megatron-core BlendedDataset's sample order,
resumable at any batch, split across ranks, and refused in one line when malformed."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from harness.config.schema import DataConfig
from harness.data import build_data, data_fingerprint
from harness.data.blend import BlendIndex, normalize
from tests.test_data import write_megatron

SEQ = 8


def megatron_build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """A line-by-line transcription of megatron-core's build_blending_indices
    (megatron/core/datasets/helpers.cpp L77-129 at NVIDIA/Megatron-LM d98e8a64dd), with the weights
    normalized as BlendedDataset.__init__ does (`normalize`, megatron/core/datasets/utils.py L33-46).
    Where megatron-core is installed its compiled helper is used instead (megatron-core 0.16.1's gave
    the same arrays as lowp for these weights, and for 200,000 samples)."""
    try:  # the compiled helper itself, where megatron-core is installed and built
        from megatron.core.datasets import helpers

        dataset_index = np.zeros(size, dtype=np.int16)
        dataset_sample_index = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(
            dataset_index, dataset_sample_index, weights, len(weights), size, False
        )
        return dataset_index, dataset_sample_index
    except ImportError:
        pass
    num_datasets = len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    current_samples = [0] * num_datasets
    for sample_idx in range(size):
        sample_idx_double = max(float(sample_idx), 1.0)
        max_error_index = 0
        max_error = weights[0] * sample_idx_double - float(current_samples[0])
        for dataset_idx in range(1, num_datasets):
            error = weights[dataset_idx] * sample_idx_double - float(current_samples[dataset_idx])
            if error > max_error:
                max_error = error
                max_error_index = dataset_idx
        dataset_index[sample_idx] = max_error_index
        dataset_sample_index[sample_idx] = current_samples[max_error_index]
        current_samples[max_error_index] += 1
    return dataset_index, dataset_sample_index


@pytest.mark.parametrize("raw", [[0.3, 0.7], [30, 70], [1, 2, 3], [0.5, 0.5], [0.05, 0.9, 0.05]])
def test_order_is_megatron_cores(raw):
    weights = normalize(raw)
    want = megatron_build_blending_indices(weights, 3000)
    index = BlendIndex(weights)
    for stop in (1, 7, 500, 3000):  # grown in uneven steps, as a run reaches further
        got = index[0:stop]
        np.testing.assert_array_equal(got[0], want[0][:stop])
        np.testing.assert_array_equal(got[1], want[1][:stop])
    if raw == [0.3, 0.7]:  # by hand: errors (0.3, 0.7) -> 1, (0.3, -0.3) -> 0, (-0.4, 0.4) -> 1, ...
        assert want[0][:6].tolist() == [1, 0, 1, 1, 0, 1]


@pytest.fixture(scope="module")
def blend_dir(tmp_path_factory):
    """Three Megatron datasets whose token ids tell them apart: 0-99, 100-199, 200-299."""
    d = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    for i, name in enumerate(("web", "code", "math")):
        docs = [[rng.integers(100 * i, 100 * i + 100, size=int(rng.integers(40, 80)))] for _ in range(40)]
        write_megatron(str(d / name), docs, np.uint16)
    return d


def blend_cfg(d, spec: str, **kw) -> DataConfig:
    parts = spec.split()
    path = " ".join(p if i % 2 == 0 else str(d / p) for i, p in enumerate(parts))
    return DataConfig(name="blend", path=path, vocab_size=300, **kw)


def test_batches_follow_the_blend_and_resume_exactly(blend_dir):
    data = build_data(blend_cfg(blend_dir, "0.2 web 0.5 code 0.3 math"), vocab_size=300, seq_length=SEQ)
    B = 4
    batches = [x for _, (x, _) in zip(range(30), data.train_batches(B, seed=3))]
    want, _ = megatron_build_blending_indices(normalize([0.2, 0.5, 0.3]), 30 * B)
    got = np.concatenate([(x // 100).max(dim=1).values.numpy() for x in batches])
    np.testing.assert_array_equal(got, want)  # every row from the dataset Megatron's order names
    for k in (0, 5, 29):
        x, y = next(iter(data.train_batches(B, seed=3, start=k)))
        assert x.equal(batches[k])
    ranks = [data.train_batches(B, seed=3, start=4, rank=r, world=2) for r in (0, 1)]
    assert next(ranks[0])[0].equal(batches[4]) and next(ranks[1])[0].equal(batches[5])
    assert not next(iter(data.train_batches(B, seed=4)))[0].equal(batches[0])  # the seed draws the windows
    ev = data.eval_batches(3 * B * SEQ, B)
    assert [e[0].equal(f[0]) for e, f in zip(ev, data.eval_batches(3 * B * SEQ, B))] == [True] * 3
    np.testing.assert_array_equal(
        np.concatenate([(x // 100).max(1).values.numpy() for x, _ in ev]), want[:12]
    )
    described = data.describe()
    assert [p["weight"] for p in described["blend"]] == normalize([0.2, 0.5, 0.3])
    same = data_fingerprint(blend_cfg(blend_dir, "2 web 5 code 3 math"), vocab_size=300, seq_length=SEQ)
    assert same == data.fingerprint  # weights are compared normalized, as Megatron does
    other = data_fingerprint(
        blend_cfg(blend_dir, "0.3 web 0.5 code 0.2 math"), vocab_size=300, seq_length=SEQ
    )
    assert other != data.fingerprint


def test_bad_blends_are_one_line(blend_dir, tmp_path):
    for name in ("code", "math"):  # copies, given manifests naming two tokenizers
        for ext in (".bin", ".idx"):
            shutil.copy(blend_dir / (name + ext), tmp_path / (name + ext))
    (tmp_path / "code.json").write_text(
        json.dumps({"manifest_version": 1, "vocab_size": 300, "tokenizer": "a.json", "token_dtype": "uint16"})
    )
    (tmp_path / "math.json").write_text(
        json.dumps(
            {"manifest_version": 1, "vocab_size": 300, "tokenizer": "b.model", "token_dtype": "uint16"}
        )
    )
    cases = [
        (blend_cfg(blend_dir, "1 web"), "a blend needs two or more weight/prefix pairs"),
        (blend_cfg(blend_dir, "x web 1 code"), "a weight is not a number"),
        (blend_cfg(blend_dir, "0 web 1 code"), "every weight must be > 0"),
        (blend_cfg(blend_dir, "1 web 1 nope"), "no such file"),
        (
            blend_cfg(blend_dir, "1 web 1 code", eval_path="x"),
            "a blend holds out the last data.eval_fraction",
        ),
        (
            DataConfig(name="blend", path=f"1 {tmp_path / 'code'} 1 {tmp_path / 'math'}"),
            "the datasets were prepared with different tokenizers",
        ),
    ]
    for cfg, needle in cases:
        with pytest.raises(ValueError) as err:
            build_data(cfg, vocab_size=300, seq_length=SEQ)
        assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_run_trains_on_a_blend_and_resumes_it(blend_dir, tmp_path):
    from harness.train import run
    from tests.helpers import compose_cfg

    path = f"0.25 {blend_dir / 'web'} 0.75 {blend_dir / 'code'}"
    base = ["model=gpt_tiny", "data=blend", f"data.path='{path}'", "logger=none", "log_interval=2"]
    base += [
        "data.eval_fraction=0.25",
        "eval_tokens=256",
        "micro_batch_size=2",
        "global_batch_size=2",
        "checkpoint_interval=2",
    ]
    cfg = compose_cfg(*base, "steps=6", "checkpoint_keep=3")
    straight = run(cfg, tmp_path / "run")
    assert straight.status == "completed"
    provenance = json.loads((tmp_path / "run" / "run.json").read_text())["provenance"]["data"]
    assert [p["weight"] for p in provenance["blend"]] == [0.25, 0.75]
    # back to the step-2 checkpoint: the resumed run draws the same blend batches from there on
    for ckpt in sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(ckpt)
    (tmp_path / "run" / "summary.json").unlink()
    resumed = run(cfg, tmp_path / "run")
    attempts = json.loads((tmp_path / "run" / "run.json").read_text())["attempts"]
    assert attempts[-1]["resumed_from_step"] == 2
    assert resumed.final_train_loss == straight.final_train_loss


def test_a_declared_vocabulary_is_checked_in_blended_batches(blend_dir):
    cfg = DataConfig(name="blend", path=f"1 {blend_dir / 'web'} 1 {blend_dir / 'code'}", vocab_size=150)
    data = build_data(cfg, vocab_size=300, seq_length=SEQ)
    with pytest.raises(
        ValueError, match=r"^data.vocab_size=150: the data holds token id 1\d\d; set data.vocab_size"
    ):
        next(iter(data.train_batches(4, seed=0)))
