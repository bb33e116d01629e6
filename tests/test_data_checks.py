"""Data errors: every bad token file or data setting is a one-line DataError naming the file or key and the fix."""
import json
import os

import numpy as np
import pytest

from megascale_jax import corpus, data


def _error(fn, *args, **kwargs) -> str:
    """The DataError message of fn(...), checked to be one line."""
    with pytest.raises(data.DataError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_data_error_is_a_value_error_and_missing_file_also_file_not_found(tmp_path):
    assert issubclass(data.DataError, ValueError)
    path = str(tmp_path / "absent.bin")
    with pytest.raises(FileNotFoundError):
        data.token_file_source(path, "uint16", 256)
    message = _error(data.token_file_source, path, "uint16", 256)
    assert path in message and "does not exist" in message and "--config.data.path" in message


def test_directory_empty_and_odd_length_files(tmp_path):
    message = _error(data.token_file_source, str(tmp_path), "uint16", 256)
    assert str(tmp_path) in message and "is a directory" in message and "--config.data.path" in message
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    message = _error(data.token_file_source, str(empty), "uint16", 256)
    assert "empty.bin" in message and "is empty" in message
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    message = _error(data.token_file_source, str(odd), "uint16", 256)
    assert "odd.bin" in message and "3 bytes, not a multiple of 2 (uint16)" in message
    assert "--config.data.dtype" in message


def test_ids_at_or_above_vocab_name_the_id_position_and_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_SCAN_CHUNK_TOKENS", 1000)  # several chunks: the scan is chunked
    tokens = np.full(10_000, 7)
    tokens[6543] = 4000
    tokens[8000] = 300
    path = tmp_path / "ids.bin"
    data.write_token_file(path, tokens, "uint16")
    message = _error(data.token_file_source, str(path), "uint16", 256)
    assert "ids.bin" in message and "holds token 4000 >= vocab_size 256 (at position 6543)" in message
    assert "--config.model.vocab_size" in message and "re-tokenize" in message
    assert "--config.data.dtype" in message  # a wrong dtype is a possible cause too
    assert data.token_file_source(str(path), "uint16", 4001).num_tokens == 10_000


def test_huge_file_is_sampled_and_reports_a_sampled_bad_id(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_FULL_CHECK_MAX_TOKENS", 1000)
    monkeypatch.setattr(corpus, "_SAMPLE_CHUNKS", 3)
    monkeypatch.setattr(corpus, "_SAMPLE_CHUNK_TOKENS", 100)
    tokens = np.zeros(5000, dtype=np.int64)
    tokens[2460] = 999  # inside the middle sampled chunk [2450, 2550)
    path = tmp_path / "huge.bin"
    data.write_token_file(path, tokens, "uint16")
    assert "holds token 999 >= vocab_size 256 (at position 2460)" in _error(
        data.token_file_source, str(path), "uint16", 256)


def test_too_few_tokens_for_one_window_names_seq_len_and_eval_fraction(tmp_path):
    path = tmp_path / "short.bin"
    data.write_token_file(path, np.arange(100), "uint16")
    source = data.make_source("tokens", path=str(path), dtype="uint16", vocab_size=256, seed=0)
    message = _error(data.BatchSampler, source, seq_len=128, global_batch=2, seed=0)
    assert "train region of token file" in message and "short.bin" in message
    assert "has 95 tokens" in message and "train.seq_len + 1 = 129" in message
    assert "--config.train.seq_len" in message and "lower --config.data.eval_fraction" in message
    message = _error(data.BatchSampler, source, seq_len=8, global_batch=2, seed=0, eval_fraction=0.05)
    assert "eval region" in message and "has 5 tokens" in message
    assert "raise --config.data.eval_fraction (now 0.05) or set it to 0" in message
    # eval_fraction so small that the eval region is empty: the same error, not a crash later
    assert "eval region" in _error(data.BatchSampler, source, seq_len=8, global_batch=2, seed=0,
                                   eval_fraction=0.001)
    assert data.BatchSampler(source, seq_len=8, global_batch=2, seed=0, eval_fraction=0.0)


@pytest.mark.parametrize("fraction", [1.0, 1.5, -0.1, float("nan")])
def test_eval_fraction_outside_0_1(fraction):
    source = data.synthetic_source(vocab_size=64, seed=0)
    message = _error(data.BatchSampler, source, seq_len=8, global_batch=2, seed=0, eval_fraction=fraction)
    assert "data.eval_fraction must be in [0, 1)" in message and "--config.data.eval_fraction" in message
    if fraction >= 1:
        assert "no tokens to train on" in message


def test_make_source_errors_name_the_config_key(tmp_path):
    assert "--config.data.source" in _error(data.make_source, "web", vocab_size=512, seed=0)
    assert "--config.data.path" in _error(data.make_source, "tokens", vocab_size=512, seed=0)
    assert "--config.model.vocab_size=256" in _error(data.make_source, "text", vocab_size=100, seed=0)
    path = tmp_path / "t.bin"
    data.write_token_file(path, np.arange(50), "uint16")
    message = _error(data.make_source, "tokens", path=str(path), dtype="int8", vocab_size=64, seed=0)
    assert "data.dtype must be one of" in message


# ------------------------------------------------------------------------------------ the sidecar
def test_sidecar_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 70_000, size=1000)
    path = tmp_path / "t.bin"
    data.write_token_file(path, tokens, "uint32", vocab_size=70_000)
    with open(str(path) + data.SIDECAR_SUFFIX) as f:
        assert json.load(f) == {"format_version": 1, "dtype": "uint32", "num_tokens": 1000,
                                "vocab_size": 70_000}
    source = data.token_file_source(str(path), "uint32", 70_000)
    np.testing.assert_array_equal(source.read(0, 1000), tokens)
    data.write_token_file(path, tokens[:10], "uint32")  # no vocab given: recorded as unknown
    with open(str(path) + ".json") as f:
        assert json.load(f)["vocab_size"] is None
    data.write_token_file(path, tokens[:10], "uint32", sidecar=False)  # the stale sidecar goes
    assert not os.path.exists(str(path) + ".json")


def test_sidecar_mismatches_are_data_errors(tmp_path):
    path = tmp_path / "s.bin"
    data.write_token_file(path, np.arange(1000) % 200, "uint32", vocab_size=200)
    message = _error(data.token_file_source, str(path), "uint16", 256)
    assert "s.bin" in message and "the sidecar" not in message  # names the sidecar by its path
    assert "sidecar" in message and "says uint32; set --config.data.dtype=uint32" in message
    message = _error(data.token_file_source, str(path), "uint32", 100)
    assert "vocab_size 200" in message and "--config.model.vocab_size=200" in message
    with open(path, "ab") as f:
        f.write(b"\0" * 8)  # appended to after writing
    message = _error(data.token_file_source, str(path), "uint32", 256)
    assert "1002 uint32 tokens" in message and "says 1000 tokens" in message and "write_token_file" in message
    (tmp_path / "s.bin.json").write_text("{not json")
    message = _error(data.token_file_source, str(path), "uint32", 256)
    assert "s.bin.json" in message and "unreadable" in message and "delete the sidecar" in message


def test_uint32_file_read_as_uint16_is_caught(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 50_000, size=5000)
    with_sidecar, without = tmp_path / "a.bin", tmp_path / "b.bin"
    data.write_token_file(with_sidecar, tokens, "uint32")
    data.write_token_file(without, tokens, "uint32", sidecar=False)
    assert "says uint32; set --config.data.dtype=uint32" in _error(
        data.token_file_source, str(with_sidecar), "uint16", 50_000)
    message = _error(data.token_file_source, str(without), "uint16", 50_000)
    assert "b.bin" in message and "looks like uint32 read as uint16" in message
    assert "--config.data.dtype=uint32" in message
    # ids above 65535 (a Llama-3-sized vocabulary): high halves of 0 and 1, still caught
    big = np.random.default_rng(2).integers(0, 128_256, size=5000)
    data.write_token_file(without, big, "uint32", sidecar=False)
    assert "looks like uint32" in _error(data.token_file_source, str(without), "uint16", 128_256)
    assert data.token_file_source(str(without), "uint32", 128_256).num_tokens == 5000


def test_genuine_uint16_files_without_sidecar_are_accepted(tmp_path):
    path = tmp_path / "u16.bin"
    for tokens in (np.random.default_rng(3).integers(0, 50_000, size=4096),
                   np.arange(4096) % 256,
                   np.zeros(4096, dtype=np.int64)):  # all zeros: nothing tells the dtype, so no guess
        data.write_token_file(path, tokens, "uint16", sidecar=False)
        np.testing.assert_array_equal(data.token_file_source(str(path), "uint16", 50_000).read(0, 4096),
                                      tokens)
