"""Tiles of the grouped GEMM kernels: how the work is cut, for every kernel that runs grouped GEMM tiles.

One owner per concern: a second kernel (a fused all-gather + grouped GEMM) imports these pieces instead
of copying them, and `grouped_gemm.py` keeps the kernel bodies, launch, validation and custom VJP.
  * Tiling:       `GemmTiling`, `GroupedGemmTuning` (both re-exported by grouped_gemm.py); `fit_tiling` /
                  `fit_wgrad_tiling` (the widest tiles that divide an output); `fit_smem` (pipeline depth vs
                  SMEM), `fit_ragged_tiling` (the forward / dgrad tiles as run), `sm_count` (the persistent
                  grid's size). The defaults by shape, built from these, are in `_default_tuning.py`.
  * Checks:       `check_tiling` (a hand-made tuning fits the shape), `check_dtypes`, `check_group_sizes`,
                  `check_tuning_enums`: what every entry point's validation shares, with the same messages.
  * Work tables:  in `_work_tables.py` (which rows each work item covers, computed on device).
  * Tile helpers inside kernel bodies: `swizzle_transforms`, `warpgroup_tile` (a warpgroup's part of the
                  CTA tile) and `warpgroup_mma` (its plain K-step body), `epilogue_smem` + `store_rows` /
                  `stage_zeros` (the ragged-row TMA epilogue, also storing zero tiles without any loads),
                  `mask_token_rows` and `weight_grad_step` (a weight-gradient token block: the masked x rows, then
                  the wgmma; both weight-gradient kernels run it).
The module is private (underscore); its names are not, because sibling kernels import them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._work_tables import ROW_TILE_ALIGNMENTS, TABLE_METHODS

NUM_COMPUTE_WGS = 2
INTERPRET_NUM_SMS = 3  # a few simulated SMs exercise a persistent loop without 132 CPU threads
INTERPRET_PARAMS = {}  # InterpretGPUParams options of the CPU interpreter (a test turns on detect_races)
SUPPORTED_IN_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma's 16-bit operand types
SMEM_BUDGET = 227 * 1024 - 2048  # Hopper's per-block opt-in limit, less room for the pipeline barriers


# ----------------------------------------------------------------------------------------------------
# Tiling (dataclasses, defaults by shape, SMEM fit) and the checks every grouped GEMM entry point runs
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GemmTiling:
    """Tiles of one kernel. Each of the 2 compute warpgroups owns a `tile_m x tile_n` accumulator;
    `wg_split` says whether they sit side by side along N (CTA tile tile_m x 2*tile_n) or along M.
    `schedule`: 'cooperative' (both warpgroups on one CTA tile, as above) or 'pingpong' (each warpgroup on
    its own work items of tile_m x tile_n, one's epilogue under the other's MMAs: `_pingpong_body.py`;
    wg_split and chain_items do not apply, split_k must be 1)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    wg_split: str = "n"
    grid_minor: int = 0      # 0: row tiles vary fastest in the work order (w tiles reused from L2)
    grid_tile_width: int = 8  # band width of the snake order over (row tiles, column tiles)
    epi_tile_n: int = 64     # output columns staged through SMEM per TMA store
    # SMEM staging buffers per warpgroup for the epilogue: 2 lets chunk j+1 be written while chunk j's TMA
    # store still reads its buffer (1: every chunk waits for the previous store to finish reading).
    epi_slots: int = 1
    # Chain the K pipelines of an SM's consecutive work items: the next item's loads overlap this item's
    # epilogue. Forward / input gradient: jax's chained pipelines, which need the K steps divisible by the
    # depth (else off). Weight gradient (cooperative): one SMEM ring across items, any step counts
    # (`_pingpong_body.ring_weight_grad_kernel`).
    chain_items: bool = False
    # Split the reduction (forward / input gradient only): each work item becomes split_k items over one
    # split_k-th of K each, writing fp32 partials that the launcher sums. More items for shapes with fewer
    # tiles than SMs (few tokens per expert); off (1) by default until measured.
    split_k: int = 1
    schedule: str = "cooperative"

    @property
    def cta_m(self) -> int:   # the rows of one work item (the work tables' row tile)
        if self.schedule == "pingpong":
            return self.tile_m
        return self.tile_m * (NUM_COMPUTE_WGS if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:   # the columns of one work item
        if self.schedule == "pingpong":
            return self.tile_n
        return self.tile_n * (NUM_COMPUTE_WGS if self.wg_split == "n" else 1)


SCHEDULES = ("cooperative", "pingpong")
# The ping-pong ring's depth: a warpgroup releases step k-1 only after issuing step k, so one stage would
# deadlock; its two full-barrier arrays (2 x stages) must fit the 32 barriers Mosaic tracks per array.
PINGPONG_MIN_STAGES, PINGPONG_MAX_STAGES = 2, 16


ZERO_TAILS = ("kernel", "mask", "none")   # who writes rows past sum(group_sizes): GroupedGemmTuning.zero_tail


@dataclasses.dataclass(frozen=True)
class GroupedGemmTuning:
    """Per-kernel tiles: forward `fwd`, input gradient `dgrad`, weight gradient `wgrad` (its tile_m runs
    over K, tile_n over N, tile_k over tokens). `num_sms=None` reads the device's SM count.

    `zero_tail` says who writes the zero rows past sum(group_sizes) of y and dx: 'kernel' (its tail tiles
    store zeros from SMEM: no loads, no MMA, one write of the tail), 'mask' (the kernels skip those tiles
    and a jnp.where zeroes them; XLA can fuse the select into the consumer, a standalone call pays one pass
    over the output) or 'none' (nobody: those rows are left as the buffer held them, garbage, NaN possible;
    `torch._grouped_mm`'s contract. Only for a consumer that never reads them, e.g. token_routes' combines,
    which select the real rows; the weight gradient selects its rows, so x may hold anything there, but a
    cotangent must be finite past sum(group_sizes): the transpose of such a consumer gives zeros there). A
    long tail (expert-parallel dropless buffers are n x the average rows) is where they differ;
    `benchmarks/bench_grouped_gemm.py --routings padded` times all three.

    `tables` says how the work tables are computed on device before each launch (the same tables either
    way, see `row_tile_table`): 'scan' (cumsum + searchsorted) or 'fused' (masked sums: no scan, no while
    loop), the default: on the H200 (benchmarks/results/grouped_gemm_profile_h200.json, Qwen3-30B-A3B EP1
    forward) 'scan' ran 25 small kernels (27-29 us) plus launch gaps before each ~0.2-0.3 ms GEMM, 'fused' 6
    (7-8 us): 466 -> 513 (padded), 612 -> 686 (half_empty), 586 -> 601 (uniform) TFLOP/s per call.

    `row_tiles` says where the forward / input-gradient row tiles start (see `row_tile_table`): 'group' (each
    group's tiles start at its own first row rounded down to 8, so a group of s rows costs about cdiv(s, tile)
    tiles) or 'grid' (one grid of tiles over all M rows, a tile straddling a group boundary computed once per
    group: up to one tile more per group, about half a tile on average over sizes and offsets)."""

    fwd: GemmTiling = GemmTiling()
    dgrad: GemmTiling = GemmTiling()
    wgrad: GemmTiling = GemmTiling(max_concurrent_steps=4, wg_split="m")
    num_sms: int | None = None
    zero_tail: str = "kernel"
    tables: str = "fused"
    row_tiles: str = "group"


def fit_tiling(base: GemmTiling, n_cols: int, name: str) -> GemmTiling:
    """Widest CTA tile along N that divides `n_cols` (TMA blocks must not straddle the edge)."""
    for split, tile_n in (("n", 128), ("m", 128), ("m", 64)):
        if n_cols % (tile_n * (NUM_COMPUTE_WGS if split == "n" else 1)) == 0:
            return dataclasses.replace(base, wg_split=split, tile_n=tile_n, epi_tile_n=min(64, tile_n))
    raise ValueError(f"{name}={n_cols} must be a multiple of 64; pad the weights to a multiple of 64")


def fit_wgrad_tiling(base: GemmTiling, k: int, n: int) -> GemmTiling:
    """dw tiles are (K rows x N columns); the widest pair of warpgroup tiles that divides both."""
    for split, tile_m, tile_n in (("m", 128, 128), ("n", 128, 128), ("m", 64, 128), ("n", 64, 64), ("m", 64, 64)):
        cta_m = tile_m * (NUM_COMPUTE_WGS if split == "m" else 1)
        cta_n = tile_n * (NUM_COMPUTE_WGS if split == "n" else 1)
        if k % cta_m == 0 and n % cta_n == 0:
            return dataclasses.replace(base, wg_split=split, tile_m=tile_m, tile_n=tile_n, epi_tile_n=64)
    raise ValueError(f"weight gradient needs K={k} or N={n} to be a multiple of 128 (the other of 64); "
                     "pad the weights")


def persistent_kernel(body, out_type, num_sms: int, interpret: bool):
    """The launch every grouped-GEMM-tile kernel shares: a persistent grid of `num_sms` CTAs ('sm'), each with
    the compute warpgroups and one memory warpgroup ('wg'), warpgroup lowering; `interpret` runs it in the
    CPU interpreter. Returns the callable of the kernel's operands."""
    return plgpu.kernel(
        body, out_type=out_type, grid=(num_sms,), grid_names=("sm",), num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg", compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(**INTERPRET_PARAMS) if interpret else False)


def sm_count(interpret: bool) -> int:
    """The persistent grid's size: the device's SMs, or INTERPRET_NUM_SMS in the CPU interpreter."""
    return INTERPRET_NUM_SMS if interpret else jax.devices()[0].core_count


def fit_smem(cfg: GemmTiling, stage_elems: int, out_dtype) -> GemmTiling:
    """Drops pipeline stages (to 2) until the input buffers plus the epilogue staging fit in SMEM (an fp32
    output doubles the staging); if two stages still do not fit, halves tile_k and tries again (a 128-wide
    K step with an fp32 output). `stage_elems` is the elements of one stage at cfg.tile_k."""
    out_bytes = NUM_COMPUTE_WGS * cfg.epi_slots * cfg.tile_m * cfg.epi_tile_n * jnp.dtype(out_dtype).itemsize
    steps = cfg.max_concurrent_steps
    while steps > 2 and steps * stage_elems * 2 + out_bytes > SMEM_BUDGET:
        steps -= 1
    if steps * stage_elems * 2 + out_bytes > SMEM_BUDGET:
        if cfg.tile_k <= 64:
            raise ValueError(f"tiles {cfg} need {steps * stage_elems * 2 + out_bytes} bytes of SMEM with 2 "
                             f"stages, over the {SMEM_BUDGET} available: use smaller tile_m / tile_n / epi_tile_n")
        half = dataclasses.replace(cfg, tile_k=cfg.tile_k // 2, max_concurrent_steps=2 * steps)
        return fit_smem(half, stage_elems // 2, out_dtype)
    return dataclasses.replace(cfg, max_concurrent_steps=steps)


def fit_ragged_tiling(cfg, k_dim: int, out_dtype, operand_cols: int | None = None):
    """The forward / input-gradient tiles as they run: pipeline depth fitted to SMEM, and chained pipelines
    only where a depth >= 2 divides the K steps. `operand_cols`: the weight columns one stage holds (default
    cta_n; a kernel with two weight operands holds twice its tile)."""
    cfg = fit_smem(cfg, (cfg.cta_m + (operand_cols or cfg.cta_n)) * cfg.tile_k, out_dtype)
    if cfg.schedule == "pingpong":   # one ring of stages across all items: nothing to chain
        return dataclasses.replace(cfg, chain_items=False)
    if cfg.chain_items:   # chained pipelines need the K steps (of one split) to be a multiple of the depth
        steps = k_dim // cfg.tile_k // cfg.split_k
        depths = [s for s in range(cfg.max_concurrent_steps, 1, -1) if steps % s == 0]
        # the deepest that divides; none (an odd prime step count): unchained at the full depth
        cfg = dataclasses.replace(cfg, max_concurrent_steps=depths[0], chain_items=True) if depths else \
            dataclasses.replace(cfg, chain_items=False)
    return cfg


def check_tiling(name: str, cfg: GemmTiling, dims_and_tiles, what: str, split: bool = True):
    """A tuning passed by hand must still tile the shape exactly: TMA blocks never straddle an edge."""
    if not isinstance(cfg.split_k, int) or cfg.split_k < 1 or (cfg.split_k > 1 and not split):
        raise ValueError(f"tuning.{name}.split_k={cfg.split_k!r} must be an int >= 1" +
                         ("" if split else f" and 1 for the {what} kernel (it does not split its reduction)"))
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"tuning.{name}.schedule={cfg.schedule!r} must be one of {SCHEDULES}")
    if cfg.schedule == "pingpong" and cfg.split_k > 1:
        raise ValueError(f"tuning.{name}.schedule='pingpong' needs split_k=1 (got split_k={cfg.split_k}): use "
                         "schedule='cooperative' to split the reduction")
    ring = "schedule='pingpong'" if cfg.schedule == "pingpong" else \
        "a chained weight gradient (chain_items=True)" if name == "wgrad" and cfg.chain_items else None
    if ring and not PINGPONG_MIN_STAGES <= cfg.max_concurrent_steps <= PINGPONG_MAX_STAGES:
        raise ValueError(f"tuning.{name}.max_concurrent_steps={cfg.max_concurrent_steps} must be in "
                         f"[{PINGPONG_MIN_STAGES}, {PINGPONG_MAX_STAGES}] with {ring} (one SMEM ring)")
    if cfg.wg_split not in ("m", "n"):
        raise ValueError(f"tuning.{name}.wg_split must be 'm' or 'n', got {cfg.wg_split!r}")
    if cfg.tile_n % cfg.epi_tile_n:
        raise ValueError(f"tuning.{name}.epi_tile_n={cfg.epi_tile_n} must divide tile_n={cfg.tile_n}")
    if cfg.epi_slots not in (1, 2):
        raise ValueError(f"tuning.{name}.epi_slots={cfg.epi_slots} must be 1 or 2 (SMEM staging buffers)")
    for label, dim, tile in dims_and_tiles:
        if dim % tile:
            raise ValueError(f"{what}: {label} {dim} is not a multiple of the tuning.{name} tile {tile}; pad "
                             "the weights (K and N to multiples of 64) or pass another tuning")


def check_group_sizes(group_sizes_G, g):
    if group_sizes_G.shape != (g,) or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"group_sizes_G must be an integer vector of shape ({g},) (one size per weight "
                         f"group); got {group_sizes_G.dtype} {group_sizes_G.shape}")


def check_dtypes(a_name, a, b_name, b, preferred_element_type):
    """Both operands in one 16-bit dtype (wgmma's rule); returns the output dtype."""
    if a.dtype != b.dtype or a.dtype not in SUPPORTED_IN_DTYPES:
        raise ValueError(f"{a_name} and {b_name} must share dtype bfloat16 or float16; got {a.dtype} and "
                         f"{b.dtype}: cast them (the kernel accumulates in float32 either way)")
    out_dtype = jnp.dtype(preferred_element_type or a.dtype)
    if out_dtype not in (jnp.dtype(a.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"preferred_element_type must be None, {a.dtype} or float32; got {out_dtype}")
    return out_dtype


def check_tuning_enums(tuning):
    """The tuning's enums (zero_tail, tables, row_tiles)."""
    if tuning.zero_tail not in ZERO_TAILS:
        raise ValueError(f"tuning.zero_tail must be one of {ZERO_TAILS}, got {tuning.zero_tail!r}")
    if tuning.row_tiles not in ROW_TILE_ALIGNMENTS:
        raise ValueError(f"tuning.row_tiles must be one of {ROW_TILE_ALIGNMENTS}, got {tuning.row_tiles!r}")
    if tuning.tables not in TABLE_METHODS:
        raise ValueError(f"tuning.tables must be one of {TABLE_METHODS}, got {tuning.tables!r}")


# ----------------------------------------------------------------------------------------------------
# Helpers inside kernel bodies
# ----------------------------------------------------------------------------------------------------
def swizzle_transforms(minor_elems: int, dtype):
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def epilogue_smem(cfg: GemmTiling, dtype):
    """The epilogue's SMEM staging: per compute warpgroup, `epi_slots` buffers of tile_m x epi_tile_n."""
    return plgpu.SMEM((NUM_COMPUTE_WGS, cfg.epi_slots, cfg.tile_m, cfg.epi_tile_n), dtype)


def store_rows(acc, out_smem, out_gmem, row0, col0, cfg: GemmTiling, rows=None, zeros_staged=False):
    """Stores this warpgroup's accumulator (an fp32 array, or None for zeros) at out_gmem[row0:, col0:];
    `rows=(lo, count)` keeps only rows [lo, lo+count). out_smem: this warpgroup's [epi_slots, tile_m,
    epi_tile_n] staging. TMA boxes are static, so a ragged count is written as a sum of powers of two, one
    store per set bit, committed as one bulk group per chunk (rows=None: one store per chunk).
    With two slots a chunk waits only for the store two chunks back, which read the slot it overwrites.
    `zeros_staged` (acc None): every staging slot already holds zeros (`stage_zeros`), so the stores read it
    as it is, with no wait and no SMEM write: a run of zero tiles streams out back to back."""
    assert acc is None or not zeros_staged, "zeros_staged stores the staged zeros: pass acc=None"
    slots, wg_rows = out_smem.shape[0], out_smem.shape[1]
    chunks = cfg.tile_n // cfg.epi_tile_n
    for ni in range(chunks):
        slot = ni % slots
        if not zeros_staged:
            # In flight may stay: the previous chunk's group when it used the other slot (never across work items
            # when the chunk count is odd: the next item's chunk 0 reuses the slot of this item's last chunk).
            pending = 1 if slots == 2 and (ni > 0 or chunks % 2 == 0) else 0
            plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
            if acc is None:
                out_smem[slot] = jnp.zeros(out_smem.shape[1:], out_smem.dtype)
            else:
                out_smem[slot] = acc[:, ni * cfg.epi_tile_n:(ni + 1) * cfg.epi_tile_n].astype(out_smem.dtype)
            plgpu.commit_smem()
        cols = pl.ds(col0 + ni * cfg.epi_tile_n, cfg.epi_tile_n)
        src = out_smem.at[slot]
        if rows is None:
            plgpu.copy_smem_to_gmem(src, out_gmem.at[pl.ds(row0, wg_rows), cols])
            continue
        start, count = rows
        bit = 1 << (wg_rows.bit_length() - 1)
        while bit:
            pl.when((count & bit) != 0)(functools.partial(
                plgpu.copy_smem_to_gmem, src.at[pl.ds(start, bit)],
                out_gmem.at[pl.ds(row0 + start, bit), cols], commit_group=False))
            start = start + (count & bit)
            bit >>= 1
        plgpu.commit_smem_to_gmem_group()   # the chunk's stores are one bulk group for the waits above


def stage_zeros(out_smem):
    """Fills this warpgroup's staging slots with zeros once, after every store still reading them is done,
    for `store_rows(None, ..., zeros_staged=True)`."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for slot in range(out_smem.shape[0]):
        out_smem[slot] = jnp.zeros(out_smem.shape[1:], out_smem.dtype)
    plgpu.commit_smem()


class WarpgroupTile(NamedTuple):
    """Warpgroup `wg`'s part of a CTA tile: its row and column slices of the CTA's operand / accumulator
    tiles (a slice(None) on the side the warpgroups share) and its first row and column inside the CTA tile."""
    rows: object
    cols: object
    row0: object
    col0: object


def warpgroup_tile(cfg: GemmTiling, wg) -> WarpgroupTile:
    by_m, by_n = cfg.wg_split == "m", cfg.wg_split == "n"
    return WarpgroupTile(rows=pl.ds(wg * cfg.tile_m, cfg.tile_m) if by_m else slice(None),
                         cols=pl.ds(wg * cfg.tile_n, cfg.tile_n) if by_n else slice(None),
                         row0=wg * cfg.tile_m if by_m else 0, col0=wg * cfg.tile_n if by_n else 0)


def warpgroup_mma(tile: WarpgroupTile):
    """The K-step body of a pipeline over x [cta_m, tile_k] and w [tile_k, cta_n] SMEM tiles: this warpgroup's
    wgmma into its accumulator, waited for (the pipeline then releases the step's SMEM slot)."""
    def mma(_, x_smem, w_smem, acc_ref):
        plgpu.wgmma(acc_ref, x_smem.at[tile.rows], w_smem.at[:, tile.cols])
        plgpu.wgmma_wait(0)
        return acc_ref
    return mma


def weight_grad_step(acc_ref, x_tile, dy_tile, step, num_blocks, row0, start, end):
    """One token block of a weight-gradient item: acc += x_tileᵀ @ dy_tile (issued, not waited for), after
    deselecting x's rows outside the group's [start, end). Only the item's first and last blocks can hold
    rows of other groups, so only they pay for the select."""
    pl.when((step == 0) | (step == num_blocks - 1))(lambda: mask_token_rows(x_tile, row0, start, end))
    plgpu.wgmma(acc_ref, x_tile.transpose((1, 0)), dy_tile)


def mask_token_rows(ref, row0, start, end):
    """Zeroes rows of an SMEM tile whose token index is outside [start, end) (neighbouring groups or
    rows past the end). A select, not a 0/1 multiply: rows past the end may be an unwritten tail
    (zero_tail='none'), and NaN * 0 is NaN."""
    vals = ref[...]
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, vals.shape, 0), plgpu.Layout.WGMMA) + row0
    keep = (rows >= start) & (rows < end)
    ref[...] = jnp.where(keep, vals, jnp.zeros_like(vals))
    plgpu.commit_smem()
