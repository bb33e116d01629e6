"""Checkpoints: a thin owner of orbax-checkpoint's `CheckpointManager`.

One checkpoint step holds two items:
  - "state": the whole train state, a pytree of jax arrays (params, optimizer state, step,
    RNG keys), written by orbax's StandardSave (tensorstore/OCDBT, every host writes its own shards);
  - "extra": a small JSON object the trainer owns (data position, config snapshot, ...).

Saves are asynchronous by default: `save` returns once the arrays are copied off the device, the
write to disk continues in a background thread, and the next save (or `wait`/`close`) waits for it.
Only the newest `keep` steps are kept.

Restoring takes an abstract target: a pytree with the same structure whose leaves carry shape,
dtype and `.sharding` (`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`, or concrete jax arrays).
Arrays are read straight into the target's shardings, so a checkpoint written on one mesh can be
restored onto another (1 device -> 8-way sharded and back; a different data-parallel size).

RNG keys: typed key arrays (`jax.random.key`, dtype key<impl>) are stored the way orbax 0.12 does it
natively: as their `jax.random.key_data` (uint32, shape + the impl's trailing dims) with the key
impl's name in the array metadata, re-wrapped as typed keys on restore. We rely on that rather than
unwrapping keys ourselves because orbax also records the impl (threefry / rbg), which a hand-made
uint32 leaf would lose; tests/test_checkpoint.py pins the behaviour (values, impl, sharding).
Legacy raw uint32 keys (`jax.random.PRNGKey`) are plain arrays and need nothing special.

Before reading any array, `restore` compares the target with the checkpoint's metadata and raises a
CheckpointError naming every mismatched leaf (missing, unexpected, other shape or dtype); orbax would
otherwise fail deep inside tensorstore, or silently cast a dtype.

A checkpoint never holds a non-finite state: `save` refuses a state with a NaN/Inf in any floating leaf
(nothing is written), and `restore` refuses one that does (written before this check existed, or by
other code), naming the step and the leaves, so a diverged run can neither overwrite its last good
checkpoint with NaN nor resume from NaN. The check (`nonfinite_leaves`) is one jitted reduction on the
devices holding the state; only one bool per leaf reaches the host. `check_writable` lets the trainer
fail on a bad checkpoint directory before it compiles anything.

Every error here is a `CheckpointError` (a ValueError).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

log = logging.getLogger(__name__)

_STATE = "state"
_EXTRA = "extra"
_MAX_LISTED_MISMATCHES = 8
_MAX_LISTED_NONFINITE = 3
_CONFIG_CHANGED_HINT = (
    "The model/optimizer config probably changed since this checkpoint was written (model dimensions, "
    "train.param_dtype, train.adam_moments_dtype, ...): restore with the config it was written with, or start a "
    "fresh run with a new --config.checkpoint.dir."
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message names the directory / step and the fix."""


def check_writable(directory: str) -> None:
    """Raises CheckpointError (one line) unless `directory` is, or can be created as, a writable folder.

    Cheap (a mkdir and a probe file), so the trainer calls it before compiling: a bad checkpoint.dir
    would otherwise surface only at the first save, after compiling and training.
    """
    if not directory:
        raise CheckpointError("checkpoint directory is empty: set --config.checkpoint.dir to a folder.")
    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"checkpoint.dir {path} is a file, not a directory; set "
                              "--config.checkpoint.dir to a folder (it is created if missing).")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"checkpoint.dir {path} cannot be created ({err.strerror}); set "
                              "--config.checkpoint.dir to a folder you can write.") from None
    try:  # a real write: permission bits say nothing of read-only mounts or quotas
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write_check_")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise CheckpointError(f"checkpoint.dir {path} is not writable ({err.strerror}); fix its "
                              "permissions or set --config.checkpoint.dir to a folder you can write.") from None


@jax.jit
def _nonfinite_flags(leaves: tuple) -> jax.Array:
    """bool [len(leaves)]: whether each leaf holds a NaN or Inf. Reduced where the shards live."""
    return jnp.stack([jnp.logical_not(jnp.all(jnp.isfinite(x))) for x in leaves])


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths ('params/embed', 'opt/0/mu/w') of the floating leaves of `tree` holding a NaN or Inf.

    jax arrays are reduced on their own devices by one jitted call per mesh (a train state lives on one,
    so one call), sharded arrays shard by shard, and only one bool per leaf is copied to the host; on
    several hosts every process gets the same answer. Non-jax leaves (numpy, Python floats) are checked
    with numpy. Integer, bool and key leaves cannot be non-finite and are skipped.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    bad = [False] * len(flat)
    groups: dict[Any, list[int]] = {}  # one jit call per mesh / device set: jit needs one for all inputs
    for i, (_, leaf) in enumerate(flat):
        if isinstance(leaf, jax.Array):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                sharding = leaf.sharding
                key = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) \
                    else frozenset(sharding.device_set)
                groups.setdefault(key, []).append(i)
        elif np.issubdtype(np.asarray(leaf).dtype, np.inexact):
            bad[i] = not bool(np.isfinite(np.asarray(leaf)).all())
    for indices in groups.values():
        flags = _nonfinite_flags(tuple(flat[i][1] for i in indices))
        if not (flags.is_fully_addressable or flags.is_fully_replicated):
            from jax.experimental import multihost_utils
            flags = multihost_utils.process_allgather(flags, tiled=True)
        for i, flag in zip(indices, np.asarray(flags).tolist()):
            bad[i] = flag
    return [_path_str(path) for (path, _), is_bad in zip(flat, bad) if is_bad]


def _listed(names: list[str]) -> str:
    more = len(names) - _MAX_LISTED_NONFINITE
    return ", ".join(names[:_MAX_LISTED_NONFINITE]) + (f" and {more} more leaves" if more > 0 else "")


class Checkpointer:
    """Periodic async checkpoints of (train state, JSON extra) under one directory.

    Args:
      directory: where step folders go (created if missing); a relative path is made absolute.
      save_every: `maybe_save` writes when `step % save_every == 0`; 0 = never periodically
        (only `save` or `maybe_save(..., force=True)`).
      keep: how many of the newest steps stay on disk; older ones are deleted after each save.
      async_save: write in a background thread (True) or block until the step is on disk.

    Raises CheckpointError when `directory` is a file or cannot be written (see `check_writable`).
    """

    def __init__(self, directory: str, *, save_every: int, keep: int, async_save: bool = True):
        if not directory:
            raise CheckpointError("directory is empty: pass the folder checkpoints go to "
                                  "(e.g. --config.checkpoint.dir=/path/to/run/ckpt).")
        if save_every < 0:
            raise CheckpointError(f"save_every={save_every} must be >= 0 (0 = no periodic saves).")
        if keep < 1:
            raise CheckpointError(f"keep={keep} must be >= 1: resuming needs the newest checkpoint.")
        check_writable(directory)
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            # We decide when to save (maybe_save/save) and always pass force=True, so orbax's own
            # "only save steps after the latest one" rule cannot skip a save without us knowing.
            preservation_policy=checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # half-written steps of a crashed run are never resumed
        )
        # Handlers named up front so a fresh manager (a resumed run) can read metadata before
        # anything was saved through it.
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            _STATE: ocp.StandardCheckpointHandler(),
            _EXTRA: ocp.JsonCheckpointHandler(),
        })

    # ---- queries ---------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps on disk (finished saves, plus the one in flight), ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """Newest saved step, or None when the directory holds no checkpoint."""
        return self._manager.latest_step()

    # ---- saving ----------------------------------------------------------------------------------

    def maybe_save(self, step: int, state: Any, extra: dict, *, force: bool = False) -> bool:
        """Saves when `step % save_every == 0` (or `force`); returns whether it saved.

        A step that is already on disk is not written again (returns False): after resuming at
        step N the loop's first `maybe_save(N)` would otherwise collide with the checkpoint it
        resumed from.
        """
        periodic = self.save_every > 0 and step % self.save_every == 0
        if not (periodic or force) or step in self._manager.all_steps():
            return False
        self.save(step, state, extra)
        return True

    def save(self, step: int, state: Any, extra: dict, *, force: bool = False) -> None:
        """Saves `state` and `extra` as `step`, whatever the interval.

        A step already on disk raises CheckpointError unless `force=True`, which replaces it. A state
        with a NaN/Inf in a floating leaf raises CheckpointError and writes nothing (a step being
        replaced stays as it was). Returns once the arrays are off the device (async) or on disk (sync).
        """
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise CheckpointError(f"step={step!r} must be a non-negative int (pass int(state.step)).")
        _check_json(extra)
        bad = nonfinite_leaves(state)
        if bad:
            raise CheckpointError(
                f"refusing to save step {step} to {self.directory}: the state is not finite (NaN/Inf "
                f"in {_listed(bad)}); nothing was written.")
        if step in self._manager.all_steps():
            if not force:
                raise CheckpointError(
                    f"step {step} is already saved in {self.directory}; pass force=True to "
                    "replace it, or call maybe_save, which skips steps already on disk.")
            self._manager.wait_until_finished()
            self._manager.delete(step)
        args = ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(state),
            _EXTRA: ocp.args.JsonSave(extra),
        })
        self._manager.save(int(step), args=args, force=True)

    # ---- restoring -------------------------------------------------------------------------------

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """Reads (state, extra) of `step` (the latest when None) into `abstract_state`'s shardings.

        `abstract_state`: pytree with the saved state's structure; each leaf a
        `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` or a jax.Array (its sharding is used).
        Returns arrays laid out with exactly those shardings, and the JSON extra as a dict.
        A checkpoint whose state holds a NaN/Inf raises CheckpointError naming the step to use instead.
        """
        self._manager.wait_until_finished()  # a save of ours still in flight must land first
        step = self._resolve_step(step)
        target = _abstract_target(abstract_state)
        metadata = self._manager.item_metadata(step)[_STATE]
        if metadata is None:
            raise CheckpointError(f"step {step} in {self.directory} has no '{_STATE}' item; it was not "
                             "written by megascale_jax.checkpoint.Checkpointer.")
        problems = _mismatches(target, metadata.tree)
        if problems:
            listed = "\n  ".join(problems[:_MAX_LISTED_MISMATCHES])
            more = len(problems) - _MAX_LISTED_MISMATCHES
            tail = f"\n  ... and {more} more" if more > 0 else ""
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not match the restore target "
                f"({len(problems)} leaf mismatches):\n  {listed}{tail}\n{_CONFIG_CHANGED_HINT}")
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(target),
            _EXTRA: ocp.args.JsonRestore(),
        }))
        bad = nonfinite_leaves(restored[_STATE])
        if bad:
            raise CheckpointError(self._nonfinite_restore_message(step, bad))
        return restored[_STATE], dict(restored[_EXTRA] or {})

    def _nonfinite_restore_message(self, step: int, bad: list[str]) -> str:
        folder = os.path.join(self.directory, str(step))
        earlier = [s for s in self.all_steps() if s < step]
        if earlier:
            fix = (f"restore an earlier step with step={earlier[-1]} (saved steps: {self.all_steps()}), "
                   f"or delete {folder} so the run resumes from step {earlier[-1]}")
        else:
            fix = (f"no earlier step is kept: delete {folder}, or start fresh with a new "
                   "--config.checkpoint.dir")
        return (f"checkpoint step {step} in {self.directory} holds a non-finite state (NaN/Inf in "
                f"{_listed(bad)}); {fix}.")

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint to restore in {self.directory}: the directory is empty or "
                "missing. Start from scratch, or point --config.checkpoint.dir at a run's "
                "checkpoint folder.")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"step={step} is not in {self.directory}; saved steps: {steps}.")
        return step

    # ---- lifetime --------------------------------------------------------------------------------

    def wait(self) -> None:
        """Blocks until every async save has reached disk (and old steps are deleted)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, then releases orbax's threads."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _check_json(extra: dict) -> None:
    if not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict of JSON values, got {type(extra).__name__}.")
    for key, value in extra.items():
        try:
            json.dumps({key: value})
        except TypeError as err:
            raise CheckpointError(
                f"extra[{key!r}] is not JSON-serialisable ({err}); convert it first, e.g. "
                "int(x) / float(x) for numpy or jax scalars, dataclasses.asdict(cfg) for configs."
            ) from None


def _abstract_target(abstract_state: Any) -> Any:
    """ShapeDtypeStruct leaves with shardings; a leaf without one is an error naming it."""
    def to_abstract(path, leaf):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise CheckpointError(
                f"abstract_state leaf {_path_str(path)} ({type(leaf).__name__}) has no sharding: "
                "give every leaf one, e.g. jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=...) "
                "or jax.eval_shape(init_fn) under jit with out_shardings.")
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(to_abstract, abstract_state)


def _stored_shape_dtype(leaf: jax.ShapeDtypeStruct) -> tuple[tuple[int, ...], np.dtype]:
    """What orbax writes for this leaf: typed keys are stored as their uint32 key_data."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _mismatches(target: Any, stored_tree: Any) -> list[str]:
    """Human-readable differences between the target and the checkpoint's metadata tree."""
    want = {_path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(target)[0]}
    have = {_path_str(p): meta for p, meta in jax.tree_util.tree_flatten_with_path(stored_tree)[0]}
    problems = [f"{name}: in the target but not in the checkpoint" for name in want
                if name not in have]
    problems += [f"{name}: in the checkpoint but not in the target" for name in have
                 if name not in want]
    for name in want.keys() & have.keys():
        shape, dtype = _stored_shape_dtype(want[name])
        stored_shape, stored_dtype = tuple(have[name].shape), np.dtype(have[name].dtype)
        if (shape, dtype) != (stored_shape, stored_dtype):
            problems.append(f"{name}: checkpoint has {stored_dtype}{list(stored_shape)}, "
                            f"target wants {dtype}{list(shape)}")
    return sorted(problems)


def _path_str(path: tuple) -> str:
    """'params/layers/0/w': one spelling for dict keys, attributes and sequence indices, since
    orbax's metadata turns attribute nodes (namedtuples, nnx.Variable) into dicts."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts) or "<root>"
