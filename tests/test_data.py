"""harness.data: batching contract (shapes, determinism, resume, fixed eval), each source, errors."""

from __future__ import annotations

import itertools
import json
import math
import struct

import numpy as np
import pytest
import torch

from harness.config.schema import DataConfig
from harness.data import build_data
from harness.data.base import BLOCK
from harness.data.markov import entropy_rate, stationary_distribution, transition_matrix

T = 16  # seq_length of every test source
VOCAB = 256  # the model's vocabulary unless a test says otherwise


def write_megatron(prefix: str, docs: list[list[np.ndarray]], dtype: type) -> None:
    """A Megatron indexed dataset, byte for byte as IndexedDatasetBuilder + _IndexWriter write it."""
    lengths, document_indices = [], [0]
    with open(prefix + ".bin", "wb") as fh:
        for doc in docs:
            for seq in doc:
                arr = np.array(seq, dtype=dtype)
                fh.write(arr.tobytes(order="C"))
                lengths.append(arr.size)
            document_indices.append(len(lengths))
    itemsize, pointers, ptr = np.dtype(dtype).itemsize, [], 0
    for n in lengths:
        pointers.append(ptr)
        ptr += n * itemsize
    code = {np.uint16: 8, np.int32: 4}[dtype]
    with open(prefix + ".idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00")
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", code))
        fh.write(struct.pack("<Q", len(lengths)))
        fh.write(struct.pack("<Q", len(document_indices)))
        fh.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        fh.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        fh.write(np.array(document_indices, dtype=np.int64).tobytes(order="C"))


def random_docs(rng: np.random.Generator, n_docs: int, vocab: int) -> list[list[np.ndarray]]:
    """Documents of 1-3 sequences of 5-60 tokens each."""
    return [
        [rng.integers(0, vocab, rng.integers(5, 60)) for _ in range(rng.integers(1, 4))]
        for _ in range(n_docs)
    ]


@pytest.fixture(params=["synthetic", "markov", "stdlib_bytes", "memmap", "megatron"])
def data(request, tmp_path):
    name = request.param
    cfg = DataConfig(name=name, num_tokens=20_000, vocab_size=None)
    if name == "markov":
        cfg.vocab_size = 32
    elif name == "stdlib_bytes":
        cfg.num_tokens = 100_000
    elif name == "memmap":
        np.random.default_rng(0).integers(0, VOCAB, 5000).astype(np.uint16).tofile(tmp_path / "tok.bin")
        cfg.path = str(tmp_path / "tok.bin")
    elif name == "megatron":
        write_megatron(str(tmp_path / "ds"), random_docs(np.random.default_rng(0), 200, VOCAB), np.uint16)
        cfg.path = str(tmp_path / "ds")
    return build_data(cfg, vocab_size=VOCAB, seq_length=T)


def take(it, n):
    return list(itertools.islice(it, n))


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True)
    )


# -- the batching contract, for every source ---------------------------------------------------------


def test_shapes_dtypes_and_shift(data):
    for x, y in take(data.train_batches(3, seed=0), 4) + data.eval_batches(200, 3):
        assert x.shape == y.shape == (3, T) and x.dtype == y.dtype == torch.int64
        assert x.device.type == "cpu" and x.is_contiguous() and y.is_contiguous()
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert 0 <= int(x.min()) and int(torch.maximum(x, y).max()) < data.vocab_size <= VOCAB


def test_windows_come_from_the_splits(data):
    if data.name == "synthetic":
        pytest.skip("no stream: tokens are drawn on the fly")
    train = np.asarray(data.train, dtype=np.int64)
    for x, y in take(data.train_batches(4, seed=1), 3):
        for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
            window = np.concatenate([row_x, row_y[-1:]])
            starts = np.flatnonzero(train[: len(train) - T] == window[0])
            assert any(np.array_equal(train[s : s + T + 1], window) for s in starts)
    (x, y), *_ = data.eval_batches(2 * T, 2)  # contiguous windows from the eval split's start
    held = np.asarray(data.eval[: 2 * T + 1], dtype=np.int64)
    assert np.array_equal(x.flatten().numpy(), held[:-1]) and np.array_equal(y[-1].numpy(), held[T + 1 :])


def test_same_seed_same_batches_other_seed_differs(data):
    a, b, c = (take(data.train_batches(2, seed=s), 5) for s in (7, 7, 8))
    assert same(a, b) and not same(a, c)


def test_resume_equals_skipping(data):
    fresh = take(data.train_batches(2, seed=3), BLOCK + 6)
    for start in (1, 5, BLOCK - 2, BLOCK + 1):  # within the first generator block and across it
        resumed = take(data.train_batches(2, seed=3, start=start), 5)
        assert same(resumed, fresh[start : start + 5]), start


def test_eval_fixed_across_calls_and_seeds(data):
    first = data.eval_batches(5 * 2 * T - 1, 2)
    assert len(first) == 5 and same(first, data.eval_batches(5 * 2 * T - 1, 2))
    take(data.train_batches(2, seed=99), 3)  # training draws do not move the eval set
    assert same(first, data.eval_batches(5 * 2 * T - 1, 2))
    assert data.eval_batches(0, 2) == []
    assert len(data.eval_batches(2 * T + 1, 2)) == 2  # ceil(eval_tokens / (B*T))


def test_describe(data):
    d = data.describe()
    for key in ("name", "vocab_size", "train_tokens", "eval_tokens", "fingerprint", "loss_floor"):
        assert key in d
    assert d["name"] == data.name and len(d["fingerprint"]) == 64
    json.dumps(d)


# -- markov ---------------------------------------------------------------------------------------------


def test_markov_entropy_rate_brute_force():
    """H(X_n | X_1..X_{n-1}) of the stationary chain, by enumerating all sequences, is the rate."""
    P = transition_matrix(3, 0.7, np.random.default_rng(5))
    w, v = np.linalg.eig(P.T)
    pi = np.real(v[:, np.argmin(np.abs(w - 1))])
    pi /= pi.sum()
    assert np.allclose(stationary_distribution(P), pi, atol=1e-12)

    def block_entropy(n):
        h = 0.0
        for seq in itertools.product(range(3), repeat=n):
            p = pi[seq[0]] * np.prod([P[a, b] for a, b in itertools.pairwise(seq)])
            h -= p * math.log(p)
        return h

    assert entropy_rate(P, pi) == pytest.approx(block_entropy(6) - block_entropy(5), abs=1e-10)


def test_markov_empirical_conditional_entropy_matches_floor():
    data = build_data(
        DataConfig(name="markov", vocab_size=16, alpha=0.5, num_tokens=300_000),
        vocab_size=VOCAB,
        seq_length=T,
    )
    s = np.concatenate([data.train, data.eval]).astype(np.int64)
    counts = np.zeros((16, 16))
    np.add.at(counts, (s[:-1], s[1:]), 1)
    nz = counts > 0
    cond = counts / counts.sum(axis=1, keepdims=True)
    empirical = -(counts[nz] / counts.sum() * np.log(cond[nz])).sum()
    assert data.loss_floor == pytest.approx(empirical, abs=0.02)
    assert data.loss_floor < data.describe()["marginal_entropy"] < math.log(16)


def test_markov_default_size_generates_and_is_seeded():
    """The preset's 2M tokens (generation speed sanity: this test is the timing)."""
    a = build_data(DataConfig(name="markov"), vocab_size=VOCAB, seq_length=T)
    assert a.train_tokens + a.eval_tokens == 2_000_000 and a.eval_tokens == 100_000
    assert a.describe()["alpha"] == 0.05 and 0 < a.loss_floor < math.log(VOCAB)
    b = build_data(DataConfig(name="markov", num_tokens=50_000, seed=1), vocab_size=VOCAB, seq_length=T)
    c = build_data(DataConfig(name="markov", num_tokens=50_000, seed=1), vocab_size=VOCAB, seq_length=T)
    assert b.fingerprint == c.fingerprint and b.fingerprint != a.fingerprint
    assert np.array_equal(b.train, c.train)


def test_synthetic_floor_and_vocab():
    data = build_data(DataConfig(name="synthetic", vocab_size=100), vocab_size=VOCAB, seq_length=T)
    assert data.vocab_size == 100 and data.loss_floor == pytest.approx(math.log(100))
    x, _ = next(data.train_batches(64, seed=0))
    assert int(x.max()) < 100
    # the eval stream is not the train stream of any seed
    assert not same(data.eval_batches(2 * T, 2), take(data.train_batches(2, seed=0), 1))


# -- stdlib_bytes -------------------------------------------------------------------------------------


def test_stdlib_bytes_fingerprint_stable_and_text():
    cfg = DataConfig(name="stdlib_bytes", num_tokens=200_000)
    a, b = (build_data(cfg, vocab_size=VOCAB, seq_length=T) for _ in range(2))
    assert a.fingerprint == b.fingerprint and a.describe()["python_version"]
    assert a.vocab_size == 256 and a.train_tokens + a.eval_tokens == 200_000
    assert b"import " in bytes(np.asarray(a.train))
    other = build_data(DataConfig(name="stdlib_bytes", num_tokens=100_000), vocab_size=VOCAB, seq_length=T)
    assert other.fingerprint != a.fingerprint


# -- memmap ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_memmap_file_and_directory(tmp_path, dtype):
    vocab = 70_000 if dtype == "uint32" else 1000
    rng = np.random.default_rng(1)
    train, val = (rng.integers(0, vocab, n).astype(dtype) for n in (4000, 900))
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")

    one = build_data(
        DataConfig(name="memmap", path=str(tmp_path / "train.bin"), token_dtype=dtype, eval_fraction=0.1),
        vocab_size=vocab,
        seq_length=T,
    )
    assert (one.train_tokens, one.eval_tokens) == (3600, 400)
    assert np.array_equal(one.eval, train[3600:]) and one.vocab_size == int(train.max()) + 1
    assert one.describe()["path"].endswith("train.bin") and one.describe()["token_dtype"] == dtype

    folder = build_data(
        DataConfig(name="memmap", path=str(tmp_path), token_dtype=dtype), vocab_size=vocab, seq_length=T
    )
    assert (folder.train_tokens, folder.eval_tokens) == (4000, 900)
    x, y = folder.eval_batches(T, 1)[0]
    assert np.array_equal(x[0].numpy(), val[:T]) and np.array_equal(y[0].numpy(), val[1 : T + 1])
    assert folder.fingerprint != one.fingerprint

    explicit = build_data(
        DataConfig(
            name="memmap",
            path=str(tmp_path / "train.bin"),
            eval_path=str(tmp_path / "val.bin"),
            token_dtype=dtype,
        ),
        vocab_size=vocab,
        seq_length=T,
    )
    assert explicit.fingerprint == folder.fingerprint  # same content, same fingerprint

    declared = build_data(
        DataConfig(name="memmap", path=str(tmp_path), token_dtype=dtype, vocab_size=vocab),
        vocab_size=vocab,
        seq_length=T,
    )
    assert declared.vocab_size == vocab and declared.describe()["vocab_source"] == "data.vocab_size"


def test_memmap_large_file_fingerprint_is_partial(tmp_path):
    np.zeros(3 << 20, dtype=np.uint8).tofile(tmp_path / "big.bin")
    data = build_data(
        DataConfig(name="memmap", path=str(tmp_path / "big.bin"), vocab_size=10),
        vocab_size=VOCAB,
        seq_length=T,
    )
    assert data.describe()["fingerprint_method"] == "sha256(size, first MiB, last MiB)"


# -- megatron -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_round_trip(tmp_path, dtype):
    vocab = 300 if dtype == np.uint16 else 66_000
    docs = random_docs(np.random.default_rng(2), 40, vocab)
    write_megatron(str(tmp_path / "ds"), docs, dtype)
    seqs = [s for doc in docs for s in doc]
    stream = np.concatenate(seqs)

    data = build_data(
        DataConfig(name="megatron", path=str(tmp_path / "ds"), eval_fraction=0.1),
        vocab_size=vocab,
        seq_length=T,
    )
    held = max(1, round(len(seqs) * 0.1))
    assert np.array_equal(np.concatenate([data.train, data.eval]), stream)
    assert np.array_equal(data.eval, np.concatenate(seqs[-held:]))
    d = data.describe()
    assert (d["sequences"], d["documents"]) == (len(seqs), len(docs))
    assert d["vocab_size"] == int(stream.max()) + 1 and d["token_dtype"] == np.dtype(dtype).name

    write_megatron(str(tmp_path / "val"), random_docs(np.random.default_rng(3), 5, vocab), dtype)
    split = build_data(
        DataConfig(name="megatron", path=str(tmp_path / "ds"), eval_path=str(tmp_path / "val")),
        vocab_size=vocab,
        seq_length=T,
    )
    assert np.array_equal(split.train, stream) and split.describe()["eval_split"].endswith("val")


# -- errors: one line, naming the option ------------------------------------------------------------


def bad_files(tmp_path):
    np.tile(np.arange(300, dtype=np.uint16), 10).tofile(tmp_path / "wide.bin")  # ids up to 299
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 4002)
    (tmp_path / "bad.idx").write_bytes(b"NOTMEGATRON" + b"\x00" * 40)
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 10)
    write_megatron(str(tmp_path / "ok"), random_docs(np.random.default_rng(0), 10, 200), np.uint16)


ERRORS = [
    (dict(name="nope"), "data.name=nope"),
    (dict(name="markov", vocab_size=300), "data.vocab_size=300"),
    (dict(name="markov", vocab_size=5000), "data.vocab_size=5000"),
    (dict(name="markov", alpha=0.0), "data.alpha=0.0"),
    (dict(name="markov", vocab_size=8, num_tokens=20), "data.num_tokens=20"),  # train split < 1 window
    (dict(name="markov", vocab_size=8, num_tokens=200), "data.num_tokens=200"),  # eval split < 1 window
    (dict(name="markov", eval_fraction=1.5), "data.eval_fraction=1.5"),
    (dict(name="stdlib_bytes", vocab_size=128), "data.vocab_size=128"),
    (dict(name="memmap", path=None), "data.path=null"),
    (dict(name="memmap", path="{tmp}/missing.bin"), "data.path={tmp}/missing.bin"),
    (dict(name="memmap", path="{tmp}"), "data.path={tmp}"),  # a directory without train.bin
    (dict(name="memmap", path="{tmp}/odd.bin", token_dtype="uint32"), "data.path="),
    (dict(name="memmap", path="{tmp}/wide.bin", token_dtype="int8"), "data.token_dtype=int8"),
    (dict(name="memmap", path="{tmp}/wide.bin"), "data.vocab_size=300"),  # scanned vocab > model's
    (dict(name="memmap", path="{tmp}/wide.bin", eval_path="{tmp}/nope.bin"), "data.eval_path={tmp}/nope.bin"),
    (dict(name="megatron", path="{tmp}/missing"), "data.path={tmp}/missing"),
    (dict(name="megatron", path="{tmp}/ok.bin"), "data.path={tmp}/ok.bin"),
    (dict(name="megatron", path="{tmp}/bad"), "data.path={tmp}/bad"),
]


@pytest.mark.parametrize("kwargs,option", ERRORS, ids=[o for _, o in ERRORS])
def test_build_errors_are_one_line_naming_the_option(tmp_path, kwargs, option):
    bad_files(tmp_path)
    fill = lambda v: v.format(tmp=tmp_path) if isinstance(v, str) else v
    cfg = DataConfig(**{k: fill(v) for k, v in kwargs.items()})
    with pytest.raises(ValueError) as err:
        build_data(cfg, vocab_size=VOCAB, seq_length=T)
    message = str(err.value)
    assert "\n" not in message and message.startswith(fill(option)) and "; " in message, message


def test_batch_errors_are_one_line_naming_the_option(tmp_path):
    bad_files(tmp_path)
    cases = []
    data = build_data(
        DataConfig(name="markov", vocab_size=8, num_tokens=2000), vocab_size=VOCAB, seq_length=T
    )
    cases.append((lambda: data.eval_batches(10_000, 4), "eval_tokens=10000"))
    no_eval = build_data(
        DataConfig(name="markov", vocab_size=8, eval_fraction=0.0), vocab_size=VOCAB, seq_length=T
    )
    cases.append((lambda: no_eval.eval_batches(64, 4), "data.eval_fraction=0"))
    assert no_eval.eval_batches(0, 4) == []
    # a declared vocabulary is trusted at build time and checked on every batch
    declared = build_data(
        DataConfig(name="memmap", path=str(tmp_path / "wide.bin"), vocab_size=10),
        vocab_size=VOCAB,
        seq_length=T,
    )
    cases.append((lambda: next(declared.train_batches(4, seed=0)), "data.vocab_size=10"))
    cases.append((lambda: data.train_batches(0, seed=0), "micro_batch_size=0"))  # eager
    for call, option in cases:
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value) and str(err.value).startswith(option), str(err.value)
