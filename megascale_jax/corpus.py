"""Where tokens come from: byte tokenizer, the default real-text corpus, token files, synthetic tokens.

Every source here satisfies `megascale_jax.data.TokenSource`: `num_tokens`, `vocab_size`, and
`read(start, length) -> np.ndarray` of integer tokens, a pure function of its arguments. A source is one
flat token stream; how windows are drawn from it (and the train/eval split) lives in `data.py`. A bad
input (a missing, short or wrongly typed token file, ids >= vocab) is a `DataError`: one line naming the
file and the fix, raised when the source is opened, before anything is compiled.

The default corpus needs no network: CPython's English reference documentation
(`pydoc_data.topics.topics`) plus the docstrings of a fixed list of pure-Python standard-library modules,
read with `ast` (never imported, so nothing runs). It is a deterministic function of the Python version
(~1.5 MB on 3.12) and is cached as a .npy so later runs memory-map it instantly.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
import tempfile

import numpy as np

# Bump when the recipe below changes, so stale caches are not reused.
CORPUS_RECIPE_VERSION = 1
CACHE_ENV_VAR = "MEGASCALE_JAX_CACHE"
_DOC_SEPARATOR = "\n\n"

# Pure-Python modules (paths under the stdlib dir) with long, well-written docstrings. A fixed list keeps
# the corpus the same on every machine with the same Python; a file missing on some distribution is
# counted in the corpus metadata rather than silently changing the data.
STDLIB_DOC_FILES = (
    "argparse.py", "ast.py", "asyncio/events.py", "asyncio/tasks.py", "bisect.py", "calendar.py",
    "collections/__init__.py", "concurrent/futures/_base.py", "configparser.py", "contextlib.py",
    "copy.py", "csv.py", "dataclasses.py", "difflib.py", "doctest.py", "email/message.py", "enum.py",
    "fractions.py", "functools.py", "gettext.py", "heapq.py", "http/client.py", "http/cookiejar.py",
    "http/server.py", "inspect.py", "ipaddress.py", "json/__init__.py", "logging/__init__.py",
    "logging/handlers.py", "mailbox.py", "multiprocessing/pool.py", "optparse.py", "os.py",
    "pathlib.py", "pdb.py", "pickle.py", "pprint.py", "_pydatetime.py", "_pydecimal.py", "pydoc.py",
    "random.py", "shutil.py", "smtplib.py", "socket.py", "statistics.py", "string.py", "subprocess.py",
    "tarfile.py", "tempfile.py", "textwrap.py", "threading.py", "tokenize.py", "traceback.py",
    "typing.py", "unittest/case.py", "unittest/mock.py", "urllib/parse.py", "urllib/request.py",
    "uuid.py", "warnings.py", "weakref.py", "zipfile/__init__.py",
)


class DataError(ValueError):
    """A bad data input (token file, data.* setting): one line naming the file or key, and the fix."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """The token file does not exist; also a FileNotFoundError for callers that catch that."""


# ----------------------------------------------------------------------------------------- tokenizer
@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no special tokens, lossless for any str."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """str -> uint16 [num_bytes]."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode: text must be str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens) -> str:
        """Integer tokens in [0, 256) -> str; invalid UTF-8 sequences become U+FFFD."""
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(
                f"ByteTokenizer.decode: tokens must lie in [0, {self.vocab_size}), got range "
                f"[{tokens.min()}, {tokens.max()}]; these tokens were not made by a byte tokenizer")
        return tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------ array-backed source
@dataclasses.dataclass(frozen=True)
class ArrayTokenSource:
    """A 1-D token array (in memory or np.memmap) as a TokenSource.

    `read` checks every token it returns against `vocab_size`, so a bad token can never reach the model
    even when the file was only sampled at open.
    """

    tokens: np.ndarray
    vocab_size: int
    description: str

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def read(self, start: int, length: int) -> np.ndarray:
        check_read_range(self, start, length)
        window = np.asarray(self.tokens[start:start + length])
        if length and int(window.max()) >= self.vocab_size:
            bad = start + int(np.argmax(window >= self.vocab_size))
            raise DataError(
                f"{self.description}: token {int(self.tokens[bad])} at position {bad} is >= vocab_size "
                f"{self.vocab_size}; pass the vocab size the tokens were made with, or re-tokenize")
        return window


def check_read_range(source, start: int, length: int) -> None:
    """Shared argument check for TokenSource.read implementations."""
    if start < 0 or length < 0 or start + length > source.num_tokens:
        raise ValueError(
            f"read(start={start}, length={length}) is outside the source's [0, {source.num_tokens}) "
            f"tokens; start and length must be >= 0 and start + length <= num_tokens")


# --------------------------------------------------------------------------------- default corpus
def _docstrings_in_source_order(node: ast.AST):
    """Module, class and function docstrings of a parsed file, in the order they appear."""
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings_in_source_order(child)


def build_corpus_text() -> tuple[str, dict]:
    """The default corpus text and its metadata (files used and missing, sizes, Python version)."""
    from pydoc_data.topics import topics  # CPython's own English reference docs, always shipped

    documents = [f"{name}{_DOC_SEPARATOR}{topics[name]}" for name in sorted(topics)]
    stdlib_dir = sysconfig.get_path("stdlib")
    used, missing = [], []
    for relative_path in STDLIB_DOC_FILES:
        path = os.path.join(stdlib_dir, relative_path)
        if not os.path.isfile(path):
            missing.append(relative_path)
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        documents.extend(_docstrings_in_source_order(tree))
        used.append(relative_path)
    text = _DOC_SEPARATOR.join(documents)
    metadata = {
        "recipe_version": CORPUS_RECIPE_VERSION,
        "python_version": sys.version.split()[0],
        "pydoc_topics": len(topics),
        "stdlib_files_used": used,
        "stdlib_files_missing": missing,
        "num_bytes": len(text.encode("utf-8")),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }
    return text, metadata


def resolve_cache_dir(cache_dir: str | None) -> str:
    """The argument, else $MEGASCALE_JAX_CACHE, else ~/.cache/megascale_jax."""
    if cache_dir:
        return os.path.expanduser(cache_dir)
    return os.path.expanduser(os.environ.get(CACHE_ENV_VAR) or "~/.cache/megascale_jax")


def corpus_cache_path(cache_dir: str | None = None) -> str:
    """Where the tokenized default corpus for this Python version lives."""
    version = sys.version.split()[0]
    name = f"text_corpus_py{version}_v{CORPUS_RECIPE_VERSION}.npy"
    return os.path.join(resolve_cache_dir(cache_dir), name)


def _atomic_write(path: str, write_fn) -> None:
    """Write via a temporary file in the same directory, then rename: concurrent processes (several
    hosts on one shared file system) see either no file or a complete one."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=".tmp_", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def default_text_source(cache_dir: str | None = None) -> ArrayTokenSource:
    """CPython reference docs + stdlib docstrings, byte-tokenized (vocab 256), memory-mapped from cache.

    The first call builds `<cache_dir>/text_corpus_py<version>_v<recipe>.npy` (uint16 tokens) and a
    `.json` beside it (sha256, files used/missing); later calls only memory-map the .npy.
    `description` carries the sha256 prefix so hosts can confirm they read the same corpus.
    """
    path = corpus_cache_path(cache_dir)
    metadata_path = path[:-len(".npy")] + ".json"
    if not os.path.exists(path):
        text, metadata = build_corpus_text()
        tokens = ByteTokenizer().encode(text)
        _atomic_write(metadata_path, lambda f: f.write(json.dumps(metadata, indent=1).encode()))
        _atomic_write(path, lambda f: np.save(f, tokens))  # the .npy last: its presence means complete
    with open(metadata_path) as f:
        metadata = json.load(f)
    tokens = np.load(path, mmap_mode="r")
    description = f"default text corpus {path} (sha256 {metadata['sha256'][:12]})"
    return ArrayTokenSource(tokens=tokens, vocab_size=ByteTokenizer.vocab_size, description=description)


# ------------------------------------------------------------------------------------ token files
TOKEN_FILE_DTYPES = ("uint16", "uint32")
SIDECAR_SUFFIX = ".json"  # <file>.json beside the token file
SIDECAR_FORMAT_VERSION = 1
# Files up to this many tokens are scanned in full at open (4-8 GB; a sequential read); larger ones on a
# sample, and every read is still checked in full (see ArrayTokenSource.read).
_FULL_CHECK_MAX_TOKENS = 1 << 31
_SCAN_CHUNK_TOKENS = 1 << 26  # one np.max per 64 Mi tokens: bounded memory however big the file
_SAMPLE_CHUNKS, _SAMPLE_CHUNK_TOKENS = 64, 1 << 16
_DTYPE_SNIFF_TOKENS = 1 << 16  # the head of a sidecar-less uint16 file checked for uint32 look


def _check_token_file_dtype(dtype: str) -> np.dtype:
    if dtype not in TOKEN_FILE_DTYPES:
        raise DataError(f"data.dtype must be one of {TOKEN_FILE_DTYPES}, got {dtype!r}; set "
                        f"--config.data.dtype to the dtype the token file was written with")
    return np.dtype(dtype)


def write_token_file(path: str, tokens, dtype: str, *, vocab_size: int | None = None,
                     sidecar: bool = True) -> None:
    """Write a 1-D array of non-negative integer tokens as a flat binary file (no header).

    With `sidecar` (the default) `<path>.json` records {format_version, dtype, num_tokens, vocab_size}, so
    a reader with the wrong dtype or a truncated file is told, not fed garbage; `vocab_size` (optional,
    recorded as null when not given) is the tokenizer's, checked against the model's on open.
    """
    np_dtype = _check_token_file_dtype(dtype)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} {tokens.dtype}")
    limit = np.iinfo(np_dtype).max
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > limit):
        raise ValueError(
            f"tokens range [{tokens.min()}, {tokens.max()}] does not fit dtype {dtype!r} "
            f"([0, {limit}]); use 'uint32' for vocabularies above 65536")
    if vocab_size is not None and tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(f"token {int(tokens.max())} is >= vocab_size {vocab_size}")
    path = os.fspath(path)
    data = tokens.astype(np_dtype).tobytes()
    _atomic_write(path, lambda f: f.write(data))
    # The sidecar after the data: a crash in between leaves a stale sidecar whose count no longer
    # matches, which the reader reports, never a sidecar vouching for data that is not there.
    if sidecar:
        meta = {"format_version": SIDECAR_FORMAT_VERSION, "dtype": dtype, "num_tokens": int(tokens.size),
                "vocab_size": None if vocab_size is None else int(vocab_size)}
        _atomic_write(path + SIDECAR_SUFFIX, lambda f: f.write(json.dumps(meta).encode()))
    elif os.path.exists(path + SIDECAR_SUFFIX):
        os.remove(path + SIDECAR_SUFFIX)  # it described the previous contents


def _check_sidecar(path: str, dtype: str, size: int, vocab_size: int) -> dict | None:
    """The sidecar `<path>.json` (None when absent), checked against how the file is being read."""
    meta_path = path + SIDECAR_SUFFIX
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or meta.get("format_version") != SIDECAR_FORMAT_VERSION:
            raise ValueError(f"not a format_version {SIDECAR_FORMAT_VERSION} sidecar")
        stored_dtype, num_tokens, stored_vocab = meta["dtype"], meta["num_tokens"], meta["vocab_size"]
    except (ValueError, KeyError) as err:  # json.JSONDecodeError is a ValueError
        raise DataError(f"sidecar {meta_path!r} of token file {path!r} is unreadable ({err!r}); rewrite the "
                        f"file with megascale_jax.data.write_token_file, or delete the sidecar") from None
    if stored_dtype != dtype:
        raise DataError(f"token file {path!r} is read as {dtype} but its sidecar {meta_path!r} says "
                        f"{stored_dtype}; set --config.data.dtype={stored_dtype}")
    itemsize = np.dtype(dtype).itemsize
    if size != num_tokens * itemsize:
        raise DataError(
            f"token file {path!r} has {size} bytes ({size / itemsize:g} {dtype} tokens) but its sidecar "
            f"{meta_path!r} says {num_tokens} tokens; the file was changed or cut off after it was "
            f"written: rewrite it with write_token_file (or delete the stale sidecar)")
    if stored_vocab is not None and stored_vocab > vocab_size:
        raise DataError(
            f"token file {path!r} was tokenized with vocab_size {stored_vocab} (its sidecar says so) but "
            f"model.vocab_size is {vocab_size}; set --config.model.vocab_size={stored_vocab}")
    return meta


def _looks_like_uint32(tokens: np.ndarray, vocab_size: int) -> bool:
    """A uint32 file of ids < vocab read as uint16: every (low, high) pair recombines to a valid id, which
    for real uint16 data would need every second token to be (nearly) 0."""
    head = np.asarray(tokens[:min(tokens.shape[0], _DTYPE_SNIFF_TOKENS) & ~1]).astype(np.int64)
    if head.size < 64 or not head[0::2].any():  # too little to tell; all zeros proves nothing
        return False
    return int((head[0::2] + (head[1::2] << 16)).max()) < vocab_size


def _max_token(tokens: np.ndarray) -> tuple[int, int]:
    """(largest token, its first position): over the whole file in chunks, or over a sample when huge."""
    n = tokens.shape[0]
    if n <= _FULL_CHECK_MAX_TOKENS:
        width, starts = _SCAN_CHUNK_TOKENS, range(0, n, _SCAN_CHUNK_TOKENS)
    else:  # evenly spaced chunks, the first and the last included
        width = _SAMPLE_CHUNK_TOKENS
        starts = np.linspace(0, n - width, _SAMPLE_CHUNKS).astype(np.int64).tolist()
    best, best_start = -1, 0
    for start in starts:
        chunk_max = int(tokens[start:start + width].max())
        if chunk_max > best:
            best, best_start = chunk_max, start
    return best, best_start + int(np.argmax(np.asarray(tokens[best_start:best_start + width]) == best))


def token_file_source(path: str, dtype: str, vocab_size: int) -> ArrayTokenSource:
    """A flat binary token file (nanoGPT / Megatron .bin style) read through np.memmap.

    Checked at open, each failure a one-line DataError: the path is a non-empty file whose size is a
    multiple of the dtype; the sidecar `<path>.json`, when present, agrees on dtype, count and vocab; ids
    are < vocab_size (the whole file, chunked, up to 2**31 tokens; beyond that 64 evenly spaced chunks of
    64K tokens, first and last included); and every `read` checks the tokens it returns. Without a
    sidecar, a uint16 read whose head recombines into valid uint32 ids is refused as a likely wrong dtype.
    """
    np_dtype = _check_token_file_dtype(dtype)
    if not 1 <= vocab_size < 2**31:
        raise DataError(f"model.vocab_size must be in [1, 2**31), got {vocab_size}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DataError(f"token file {path!r} is a directory; set --config.data.path to a flat token file")
    if not os.path.exists(path):
        raise DataFileNotFoundError(
            f"token file {path!r} does not exist; fix --config.data.path, or make one with "
            f"megascale_jax.data.write_token_file({path!r}, tokens, {dtype!r})")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"token file {path!r} is empty; it needs at least one sequence of tokens: "
                        f"rewrite it, or set --config.data.path to another file")
    meta = _check_sidecar(path, dtype, size, vocab_size)
    if size % np_dtype.itemsize:
        other = "uint16" if dtype == "uint32" else "a different dtype (or the file is truncated)"
        raise DataError(
            f"token file {path!r} has {size} bytes, not a multiple of {np_dtype.itemsize} ({dtype}); "
            f"the file is probably {other}: check --config.data.dtype or rewrite the file")
    tokens = np.memmap(path, dtype=np_dtype, mode="r")
    if meta is None and dtype == "uint16" and _looks_like_uint32(tokens, vocab_size):
        raise DataError(
            f"token file {path!r} looks like uint32 read as uint16 (every second uint16 is a high half "
            f"of a valid id); set --config.data.dtype=uint32, or if it really is uint16 rewrite it with "
            f"write_token_file, whose sidecar records the dtype")
    largest, position = _max_token(tokens)
    if largest >= vocab_size:
        if dtype == "uint32":
            hint = ("or the file is uint16: reading a uint16 file as uint32 pairs tokens into large "
                    "numbers (set --config.data.dtype=uint16)")
        else:
            hint = "or the file is not uint16 (check --config.data.dtype)"
        raise DataError(
            f"token file {path!r} holds token {largest} >= vocab_size {vocab_size} (at position "
            f"{position}); set --config.model.vocab_size to the tokenizer's vocab size, re-tokenize, {hint}")
    return ArrayTokenSource(tokens=tokens, vocab_size=vocab_size, description=f"token file {path!r}")


# -------------------------------------------------------------------------------------- synthetic
_PHILOX_OUTPUTS_PER_COUNTER = 4  # Philox4x64: one counter value yields four uint64 outputs


@dataclasses.dataclass(frozen=True)
class SyntheticTokenSource:
    """Uniform random tokens: token p = Philox(key=seed, counter=p // 4)[p % 4] mod vocab_size.

    Counter-based, so any window is computed directly from its position (no state, any length).
    The modulo bias is below vocab_size / 2**64, far below anything a benchmark can see.
    """

    vocab_size: int
    seed: int
    num_tokens: int
    description: str = "synthetic tokens"

    def read(self, start: int, length: int) -> np.ndarray:
        check_read_range(self, start, length)
        first_block = start // _PHILOX_OUTPUTS_PER_COUNTER
        stop_block = -(-(start + length) // _PHILOX_OUTPUTS_PER_COUNTER)
        bit_generator = np.random.Philox(key=self.seed, counter=first_block)
        raw = bit_generator.random_raw((stop_block - first_block) * _PHILOX_OUTPUTS_PER_COUNTER)
        skip = start - first_block * _PHILOX_OUTPUTS_PER_COUNTER
        return (raw[skip:skip + length] % np.uint64(self.vocab_size)).astype(np.int64)

    def token_at_reference(self, position: int) -> int:
        """Plain twin of `read` for one position (tests check the two agree)."""
        block, lane = divmod(position, _PHILOX_OUTPUTS_PER_COUNTER)
        raw = np.random.Philox(key=self.seed, counter=block).random_raw(_PHILOX_OUTPUTS_PER_COUNTER)
        return int(raw[lane]) % self.vocab_size


def synthetic_source(vocab_size: int, seed: int, num_tokens: int = 2**40) -> SyntheticTokenSource:
    """Seeded random tokens in [0, vocab_size), deterministic by (seed, position); for benchmarks."""
    if not 1 <= vocab_size < 2**31:
        raise ValueError(f"vocab_size must be in [1, 2**31), got {vocab_size}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return SyntheticTokenSource(vocab_size=vocab_size, seed=seed, num_tokens=num_tokens,
                                description=f"synthetic tokens (vocab {vocab_size}, seed {seed})")
