"""Deterministic, resumable batches from a token stream; each data-parallel rank reads only its rows.

A batch is a pure function of (seed, step, split): global row r of step t is the window of seq_len + 1
tokens starting at an offset drawn from a counter-based generator (numpy Philox) keyed by
(seed, split) with counter (r, t). Resuming at step t needs nothing but t, and rank i of dp ranks computes
rows [i*B/dp, (i+1)*B/dp) without touching the others, so concatenating all ranks' slices in rank order
gives exactly the dp_size=1 batch. On several hosts each process calls `batch` with its own rank (or
`batch_for_rows` with the rows its devices hold, e.g. from `jax.make_array_from_callback`) and
assembles the global array from process-local data.

Train/eval split: the last `eval_fraction` of the stream (rounded down to whole tokens) is the eval
region; train windows lie wholly in the first part and eval windows wholly in the last, so they never
overlap.

Sources (tokenizer, default text corpus, token files, synthetic) live in `corpus.py` and are re-exported
here; this module is the public entry point. Bad data inputs raise `DataError` (a ValueError) with one
line naming the file or config key and the fix; `make_source` checks the file, `BatchSampler` checks that
both regions hold a window, so every data error comes before the trainer compiles.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np

from megascale_jax.corpus import (  # noqa: F401  (re-exported public API)
    SIDECAR_SUFFIX,
    TOKEN_FILE_DTYPES,
    ArrayTokenSource,
    ByteTokenizer,
    DataError,
    DataFileNotFoundError,
    SyntheticTokenSource,
    default_text_source,
    synthetic_source,
    token_file_source,
    write_token_file,
)

SPLITS = ("train", "eval")
SOURCE_KINDS = ("text", "tokens", "synthetic")
_UINT64_LIMIT = 2**64


@runtime_checkable
class TokenSource(Protocol):
    """One flat stream of integer tokens in [0, vocab_size)."""

    num_tokens: int
    vocab_size: int

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as a 1-D integer array; a pure function of its arguments."""
        ...


def make_source(kind: str, *, path: str = "", dtype: str = "uint16", vocab_size: int, seed: int,
                cache_dir: str | None = None) -> TokenSource:
    """Build the source named by a config: 'text' (default corpus), 'tokens' (file at `path`), 'synthetic'.

    `vocab_size` is the model's vocabulary; the text corpus needs >= 256 (its bytes), a token file is
    checked against it, synthetic tokens are drawn from it.
    """
    if kind == "text":
        if vocab_size < ByteTokenizer.vocab_size:
            raise DataError(
                f"model.vocab_size {vocab_size} is too small for the byte-level text corpus "
                f"(data.source='text'); set --config.model.vocab_size={ByteTokenizer.vocab_size} or more")
        return default_text_source(cache_dir)
    if kind == "tokens":
        if not path:
            raise DataError("data.source='tokens' needs path=: set --config.data.path to a flat "
                            "uint16/uint32 token file")
        return token_file_source(path, dtype, vocab_size)
    if kind == "synthetic":
        return synthetic_source(vocab_size, seed)
    raise DataError(f"unknown data source kind {kind!r}; set --config.data.source to one of {SOURCE_KINDS}")


def _split_id(split: str) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return SPLITS.index(split)


def row_offsets(seed: int, split_id: int, step: int, rows: range, num_starts: int) -> np.ndarray:
    """Start offsets (relative to the region) for `rows` of `step`, in [0, num_starts). int64 [len(rows)].

    Row r uses the first output of Philox(key=(seed, split_id), counter=(r, step, 0, 0)). Consecutive
    rows are consecutive counter values, so one generator call covers a contiguous row range.
    The modulo bias is below num_starts / 2**64.
    """
    outputs_per_counter = 4  # Philox4x64
    bit_generator = np.random.Philox(key=[seed, split_id], counter=[rows.start, step, 0, 0])
    raw = bit_generator.random_raw(len(rows) * outputs_per_counter)[::outputs_per_counter]
    return (raw % np.uint64(num_starts)).astype(np.int64)


def row_offsets_reference(seed: int, split_id: int, step: int, rows: range, num_starts: int) -> np.ndarray:
    """Plain twin of `row_offsets`: one generator per row, straight from the definition."""
    offsets = []
    for row in rows:
        raw = np.random.Philox(key=[seed, split_id], counter=[row, step, 0, 0]).random_raw(1)[0]
        offsets.append(int(raw) % num_starts)
    return np.asarray(offsets, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class BatchSampler:
    """Global batch of `global_batch` windows of seq_len + 1 tokens per (step, split).

    `batch` returns {'inputs', 'targets'}: int32 [global_batch // dp_size, seq_len], the rows
    `local_rows(dp_rank, dp_size)` of the global batch; targets are inputs shifted left by one token.
    """

    source: TokenSource
    seq_len: int
    global_batch: int
    seed: int
    eval_fraction: float = 0.05

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if not 0 <= self.seed < _UINT64_LIMIT:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not 0.0 <= self.eval_fraction < 1.0:
            why = " (1 leaves no tokens to train on)" if self.eval_fraction >= 1 else ""
            raise DataError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}{why}; set "
                            f"--config.data.eval_fraction=0.05, or 0 to hold out no eval tokens")
        if not 1 <= self.source.vocab_size < 2**31:
            raise ValueError(f"source vocab_size {self.source.vocab_size} does not fit int32 tokens")
        num_eval = self._num_eval_tokens()
        regions = {"train": self.source.num_tokens - num_eval, "eval": num_eval}
        fixes = {"train": f"lower --config.data.eval_fraction (now {self.eval_fraction})",
                 "eval": f"raise --config.data.eval_fraction (now {self.eval_fraction}) or set it to 0"}
        for split in SPLITS if self.eval_fraction > 0 else ("train",):
            if regions[split] < self.seq_len + 1:
                raise DataError(
                    f"the {split} region of {_describe(self.source)} has {regions[split]} tokens, fewer "
                    f"than one sequence of train.seq_len + 1 = {self.seq_len + 1}; use more data, lower "
                    f"--config.train.seq_len, or {fixes[split]}")

    def _num_eval_tokens(self) -> int:
        return int(self.source.num_tokens * self.eval_fraction)

    def region(self, split: str) -> tuple[int, int]:
        """[start, stop) token positions of `split`: train first, eval the last eval_fraction."""
        num_eval = self._num_eval_tokens()
        num_train = self.source.num_tokens - num_eval
        if _split_id(split) == 0:
            return 0, num_train
        if num_eval == 0:
            raise ValueError("split='eval' needs eval_fraction > 0 (and enough tokens for an eval region)")
        return num_train, self.source.num_tokens

    def local_rows(self, dp_rank: int, dp_size: int) -> range:
        """Rows of the global batch that data-parallel rank `dp_rank` of `dp_size` holds."""
        if dp_size < 1 or self.global_batch % dp_size:
            raise ValueError(
                f"global_batch {self.global_batch} must be divisible by dp_size {dp_size}; choose a "
                f"global batch that is a multiple of the data-parallel size")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        rows_per_rank = self.global_batch // dp_size
        return range(dp_rank * rows_per_rank, (dp_rank + 1) * rows_per_rank)

    def window_starts(self, step: int, split: str, rows: range) -> np.ndarray:
        """Absolute token positions where `rows` of `step` begin. int64 [len(rows)]."""
        if not 0 <= step < _UINT64_LIMIT:
            raise ValueError(f"step must be in [0, 2**64), got {step}")
        if rows.step != 1 or not 0 <= rows.start <= rows.stop <= self.global_batch:
            raise ValueError(f"rows must be a contiguous range inside [0, {self.global_batch}), got {rows}")
        start, stop = self.region(split)
        num_starts = stop - start - self.seq_len  # windows of seq_len + 1 that fit in the region
        return start + row_offsets(self.seed, _split_id(split), step, rows, num_starts)

    def batch_for_rows(self, step: int, rows: range, split: str = "train") -> dict[str, np.ndarray]:
        """{'inputs', 'targets'}: int32 [len(rows), seq_len] for any contiguous rows of the global batch."""
        windows = np.empty((len(rows), self.seq_len + 1), dtype=np.int32)
        for i, start in enumerate(self.window_starts(step, split, rows)):
            windows[i] = self.source.read(int(start), self.seq_len + 1)
        # Contiguous copies: device_put / make_array_from_process_local_data then need no extra pass.
        return {"inputs": np.ascontiguousarray(windows[:, :-1]),
                "targets": np.ascontiguousarray(windows[:, 1:])}

    def batch(self, step: int, split: str = "train", dp_rank: int = 0,
              dp_size: int = 1) -> dict[str, np.ndarray]:
        """This rank's slice of the global batch of `step`: int32 [global_batch // dp_size, seq_len]."""
        return self.batch_for_rows(step, self.local_rows(dp_rank, dp_size), split)


def _describe(source) -> str:
    return getattr(source, "description", type(source).__name__)
