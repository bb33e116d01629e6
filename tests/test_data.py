"""Data pipeline: tokenizer, default corpus + cache, token files, synthetic tokens, batch sampling."""
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from megascale_jax import corpus, data


# ------------------------------------------------------------------------------------ tokenizer
def test_byte_tokenizer_round_trip_including_non_ascii():
    tokenizer = data.ByteTokenizer()
    text = "Hello, world! Grüße — 日本語 🚀\n\ttab"
    tokens = tokenizer.encode(text)
    assert tokens.dtype == np.uint16 and tokens.ndim == 1
    assert len(tokens) == len(text.encode("utf-8")) > len(text)  # multi-byte characters
    assert tokens.max() < tokenizer.vocab_size == 256
    assert tokenizer.decode(tokens) == text
    assert tokenizer.decode(tokens.tolist()) == text


def test_byte_tokenizer_decode_replaces_invalid_utf8_and_rejects_out_of_range():
    tokenizer = data.ByteTokenizer()
    assert tokenizer.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    with pytest.raises(ValueError, match="must lie in"):
        tokenizer.decode([65, 300])
    with pytest.raises(TypeError, match="must be str"):
        tokenizer.encode(b"bytes")


# ---------------------------------------------------------------------------------- default corpus
@pytest.fixture(scope="module")
def text_cache_dir(tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("cache"))
    data.default_text_source(cache_dir)  # build once for the module
    return cache_dir


@pytest.fixture(scope="module")
def text_source(text_cache_dir):
    return data.default_text_source(text_cache_dir)


def test_default_corpus_is_real_english_text(text_source):
    assert text_source.vocab_size == 256
    assert 500_000 < text_source.num_tokens < 5_000_000
    tokens = text_source.read(0, text_source.num_tokens)
    text = data.ByteTokenizer().decode(tokens)
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text) / len(text)
    ascii_share = float(np.mean(tokens < 128))
    assert printable > 0.99 and ascii_share > 0.99
    words = text.lower().split()
    for word in ("the", "and", "function", "return", "module"):
        assert words.count(word) > 100, word
    assert "\ufffd" not in text  # valid UTF-8 throughout


def test_default_corpus_is_cached_and_not_rebuilt(text_cache_dir, text_source, monkeypatch):
    path = corpus.corpus_cache_path(text_cache_dir)
    assert os.path.exists(path) and os.path.exists(path[:-4] + ".json")
    mtime = os.path.getmtime(path)

    def fail_rebuild():
        raise AssertionError("corpus was rebuilt although a cache exists")

    monkeypatch.setattr(corpus, "build_corpus_text", fail_rebuild)
    again = data.default_text_source(text_cache_dir)
    assert os.path.getmtime(path) == mtime
    assert isinstance(again.tokens, np.memmap)
    np.testing.assert_array_equal(again.read(1000, 500), text_source.read(1000, 500))


def test_cache_dir_from_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv(corpus.CACHE_ENV_VAR, str(tmp_path))
    assert corpus.corpus_cache_path(None).startswith(str(tmp_path))
    assert corpus.corpus_cache_path("").startswith(str(tmp_path))  # config default "" means unset
    assert corpus.corpus_cache_path("/elsewhere").startswith("/elsewhere")


def test_corpus_build_is_deterministic_and_matches_cache(text_source):
    text, metadata = corpus.build_corpus_text()
    assert metadata["stdlib_files_used"] and metadata["pydoc_topics"] > 50
    np.testing.assert_array_equal(data.ByteTokenizer().encode(text), text_source.read(0, text_source.num_tokens))


# ------------------------------------------------------------------------------------ token files
@pytest.mark.parametrize("dtype, vocab", [("uint16", 50_000), ("uint32", 200_000)])
def test_token_file_round_trip(tmp_path, dtype, vocab):
    tokens = np.random.default_rng(0).integers(0, vocab, size=10_000)
    path = tmp_path / "sub" / f"tokens.{dtype}.bin"
    data.write_token_file(path, tokens, dtype)
    assert os.path.getsize(path) == 10_000 * np.dtype(dtype).itemsize
    source = data.token_file_source(str(path), dtype, vocab)
    assert source.num_tokens == 10_000 and source.vocab_size == vocab
    np.testing.assert_array_equal(source.read(0, 10_000), tokens)
    np.testing.assert_array_equal(source.read(1234, 17), tokens[1234:1251])
    assert isinstance(source, data.TokenSource)


def test_token_file_missing_names_path_and_how_to_make_one(tmp_path):
    path = str(tmp_path / "absent.bin")
    with pytest.raises(FileNotFoundError, match=r"absent\.bin.*does not exist.*write_token_file"):
        data.token_file_source(path, "uint16", 256)


def test_token_file_size_not_multiple_of_dtype_names_likely_dtype(tmp_path):
    path = tmp_path / "t.bin"
    # No sidecar (a file from another tool): the likely dtype is guessed from the size.
    data.write_token_file(path, np.arange(5), "uint16", sidecar=False)  # 10 bytes: not a multiple of 4
    with pytest.raises(ValueError, match=r"10 bytes, not a multiple of 4 \(uint32\).*probably uint16"):
        data.token_file_source(str(path), "uint32", 256)
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match=r"not a multiple of 2 \(uint16\)"):
        data.token_file_source(str(path), "uint16", 256)


def test_token_file_too_short_for_one_sequence(tmp_path):
    path = tmp_path / "short.bin"
    data.write_token_file(path, np.arange(100), "uint16")
    source = data.token_file_source(str(path), "uint16", 256)
    with pytest.raises(ValueError, match=r"train region of token file .*short\.bin.* fewer than one sequence"):
        data.BatchSampler(source, seq_len=128, global_batch=2, seed=0)
    with pytest.raises(ValueError, match=r"eval region .* fewer than one sequence"):
        data.BatchSampler(source, seq_len=8, global_batch=2, seed=0, eval_fraction=0.05)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        data.token_file_source(str(path), "uint16", 256)


def test_token_file_tokens_at_or_above_vocab_are_rejected(tmp_path):
    path = tmp_path / "v.bin"
    tokens = np.arange(1000) % 300
    data.write_token_file(path, tokens, "uint16", sidecar=False)  # no sidecar to name the dtype
    with pytest.raises(ValueError, match=r"holds token 299 >= vocab_size 256"):
        data.token_file_source(str(path), "uint16", 256)
    # A uint16 file read as uint32 pairs tokens into huge ids; the error says so.
    with pytest.raises(ValueError, match="reading a uint16 file as uint32"):
        data.token_file_source(str(path), "uint32", 300)


def test_token_file_large_file_sampled_at_open_but_every_read_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_FULL_CHECK_MAX_TOKENS", 1000)
    monkeypatch.setattr(corpus, "_SAMPLE_CHUNKS", 2)
    monkeypatch.setattr(corpus, "_SAMPLE_CHUNK_TOKENS", 100)
    tokens = np.zeros(5000, dtype=np.int64)
    tokens[2500] = 999  # between the two sampled chunks (head and tail)
    path = tmp_path / "big.bin"
    data.write_token_file(path, tokens, "uint16")
    source = data.token_file_source(str(path), "uint16", 256)
    assert source.read(0, 2000).max() == 0
    with pytest.raises(ValueError, match="token 999 at position 2500 is >= vocab_size 256"):
        source.read(2400, 200)


def test_write_token_file_rejects_what_does_not_fit(tmp_path):
    with pytest.raises(ValueError, match="does not fit dtype 'uint16'.*uint32"):
        data.write_token_file(tmp_path / "x.bin", [70_000], "uint16")
    with pytest.raises(ValueError, match="does not fit"):
        data.write_token_file(tmp_path / "x.bin", [-1], "uint32")
    with pytest.raises(ValueError, match="dtype must be one of"):
        data.write_token_file(tmp_path / "x.bin", [1], "int64")
    with pytest.raises(ValueError, match="1-D integer array"):
        data.write_token_file(tmp_path / "x.bin", [1.5], "uint16")


# -------------------------------------------------------------------------------------- synthetic
def test_synthetic_source_deterministic_in_range_and_matches_reference():
    source = data.synthetic_source(vocab_size=1000, seed=7)
    assert source.num_tokens == 2**40
    window = source.read(123_457, 64)
    assert window.min() >= 0 and window.max() < 1000
    np.testing.assert_array_equal(window, data.synthetic_source(1000, 7).read(123_457, 64))
    # position-addressed: an overlapping window agrees on the overlap, at any alignment
    np.testing.assert_array_equal(source.read(123_460, 30), window[3:33])
    assert [source.token_at_reference(123_457 + i) for i in range(64)] == window.tolist()
    assert not np.array_equal(window, data.synthetic_source(1000, 8).read(123_457, 64))
    far = source.read(2**40 - 5, 5)
    assert far.shape == (5,) and far.max() < 1000
    spread = source.read(0, 100_000)
    assert len(np.unique(spread)) == 1000  # covers the vocabulary
    with pytest.raises(ValueError, match="outside the source"):
        source.read(2**40 - 5, 6)


# --------------------------------------------------------------------------------------- make_source
def test_make_source_kinds_and_unknown_kind(tmp_path, text_cache_dir):
    assert isinstance(data.make_source("synthetic", vocab_size=512, seed=1), data.SyntheticTokenSource)
    text = data.make_source("text", vocab_size=512, seed=0, cache_dir=text_cache_dir)
    assert text.vocab_size == 256
    path = tmp_path / "t.bin"
    data.write_token_file(path, np.arange(50), "uint32")
    tokens = data.make_source("tokens", path=str(path), dtype="uint32", vocab_size=64, seed=0)
    assert tokens.num_tokens == 50
    with pytest.raises(ValueError, match=r"unknown data source kind 'web'.*'text', 'tokens', 'synthetic'"):
        data.make_source("web", vocab_size=512, seed=0)
    with pytest.raises(ValueError, match="too small for the byte-level"):
        data.make_source("text", vocab_size=100, seed=0, cache_dir=text_cache_dir)
    with pytest.raises(ValueError, match="needs path="):
        data.make_source("tokens", vocab_size=100, seed=0)


# -------------------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def ramp_sampler():
    """Token i of the stream is i % vocab: a window's content reveals where it starts."""
    source = data.ArrayTokenSource(np.arange(100_000) % 50_000, vocab_size=50_000, description="ramp")
    return data.BatchSampler(source, seq_len=32, global_batch=16, seed=3, eval_fraction=0.1)


def test_batch_shapes_dtypes_and_shifted_targets(ramp_sampler, text_source):
    batch = ramp_sampler.batch(0)
    assert set(batch) == {"inputs", "targets"}
    for array in batch.values():
        assert array.shape == (16, 32) and array.dtype == np.int32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    # on the ramp every window is consecutive, so targets are inputs + 1 exactly
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
    text_batch = data.BatchSampler(text_source, seq_len=64, global_batch=4, seed=0).batch(5)
    np.testing.assert_array_equal(text_batch["targets"][:, :-1], text_batch["inputs"][:, 1:])


def test_batches_deterministic_per_step_and_differ_across_steps_seeds_splits(ramp_sampler):
    first = ramp_sampler.batch(11)["inputs"]
    np.testing.assert_array_equal(first, ramp_sampler.batch(11)["inputs"])
    assert not np.array_equal(first, ramp_sampler.batch(12)["inputs"])
    assert not np.array_equal(first, ramp_sampler.batch(11, split="eval")["inputs"])
    other_seed = data.BatchSampler(ramp_sampler.source, seq_len=32, global_batch=16, seed=4, eval_fraction=0.1)
    assert not np.array_equal(first, other_seed.batch(11)["inputs"])
    assert len(np.unique(first[:, 0])) == 16  # rows differ within a batch


def test_resume_fresh_sampler_equals_long_lived_one(ramp_sampler):
    long_lived = [ramp_sampler.batch(step)["inputs"] for step in range(8)]
    fresh = data.BatchSampler(ramp_sampler.source, seq_len=32, global_batch=16, seed=3, eval_fraction=0.1)
    np.testing.assert_array_equal(fresh.batch(6)["inputs"], long_lived[6])
    # a step far past anything computed before needs no history either
    np.testing.assert_array_equal(fresh.batch(10**12)["inputs"], ramp_sampler.batch(10**12)["inputs"])


@pytest.mark.parametrize("dp_size", [2, 4, 8, 16])
def test_dp_slices_concatenate_to_the_full_batch(ramp_sampler, dp_size):
    for split in data.SPLITS:
        full = ramp_sampler.batch(5, split=split)
        slices = [ramp_sampler.batch(5, split=split, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
        for key in ("inputs", "targets"):
            assert all(s[key].shape == (16 // dp_size, 32) for s in slices)
            np.testing.assert_array_equal(np.concatenate([s[key] for s in slices]), full[key])


def test_bad_dp_arguments(ramp_sampler):
    with pytest.raises(ValueError, match="global_batch 16 must be divisible by dp_size 3"):
        ramp_sampler.batch(0, dp_rank=0, dp_size=3)
    with pytest.raises(ValueError, match="dp_rank must be in"):
        ramp_sampler.batch(0, dp_rank=4, dp_size=4)
    with pytest.raises(ValueError, match="split must be one of"):
        ramp_sampler.batch(0, split="test")
    assert ramp_sampler.local_rows(2, 4) == range(8, 12)


def test_global_array_assembled_from_per_shard_rows(ramp_sampler):
    """What each host does: every device's shard is computed from only its own rows."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    rows_seen = []

    def shard_of(index):
        rows = range(*index[0].indices(ramp_sampler.global_batch))
        rows_seen.append(rows)
        return ramp_sampler.batch_for_rows(9, rows)["inputs"]

    global_inputs = jax.make_array_from_callback((16, 32), sharding, shard_of)
    np.testing.assert_array_equal(np.asarray(global_inputs), ramp_sampler.batch(9)["inputs"])
    assert sorted(r.start for r in rows_seen) == list(range(0, 16, 2))
    assert all(len(r) == 2 for r in rows_seen)


def test_train_and_eval_windows_never_overlap(ramp_sampler):
    train_stop = ramp_sampler.region("train")[1]
    assert ramp_sampler.region("eval") == (train_stop, 100_000) and train_stop == 90_000
    for step in range(200):
        train_starts = ramp_sampler.window_starts(step, "train", range(16))
        eval_starts = ramp_sampler.window_starts(step, "eval", range(16))
        assert train_starts.min() >= 0 and (train_starts + 33).max() <= train_stop
        assert eval_starts.min() >= train_stop and (eval_starts + 33).max() <= 100_000
    # the windows really come from those positions (ramp content == position mod vocab)
    starts = ramp_sampler.window_starts(3, "eval", range(16))
    np.testing.assert_array_equal(ramp_sampler.batch(3, "eval")["inputs"][:, 0], starts % 50_000)


def test_row_offsets_fast_path_matches_plain_twin():
    for rows in (range(0, 32), range(5, 13)):
        fast = data.row_offsets(seed=9, split_id=1, step=77, rows=rows, num_starts=12_345)
        plain = data.row_offsets_reference(seed=9, split_id=1, step=77, rows=rows, num_starts=12_345)
        np.testing.assert_array_equal(fast, plain)
        assert fast.min() >= 0 and fast.max() < 12_345
    offsets = data.row_offsets(seed=9, split_id=0, step=0, rows=range(4096), num_starts=1000)
    assert len(np.unique(offsets)) > 950  # spread over the whole region


def test_sampler_rejects_bad_arguments(ramp_sampler):
    source = ramp_sampler.source
    with pytest.raises(ValueError, match="seq_len must be"):
        data.BatchSampler(source, seq_len=0, global_batch=2, seed=0)
    with pytest.raises(ValueError, match="global_batch must be"):
        data.BatchSampler(source, seq_len=8, global_batch=0, seed=0)
    with pytest.raises(ValueError, match="eval_fraction must be"):
        data.BatchSampler(source, seq_len=8, global_batch=2, seed=0, eval_fraction=1.0)
    with pytest.raises(ValueError, match="seed must be"):
        data.BatchSampler(source, seq_len=8, global_batch=2, seed=-1)
    no_eval = data.BatchSampler(source, seq_len=8, global_batch=2, seed=0, eval_fraction=0.0)
    assert no_eval.region("train") == (0, 100_000)
    with pytest.raises(ValueError, match="needs eval_fraction > 0"):
        no_eval.batch(0, split="eval")
    with pytest.raises(ValueError, match="step must be"):
        ramp_sampler.batch(-1)
