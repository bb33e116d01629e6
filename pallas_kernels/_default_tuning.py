"""Default tiles of the grouped GEMM kernels by shape: `default_tuning` (all three kernels of one product) and
`default_kernel_tuning` (one kernel called on its own), each rule with the measurement it comes from.
The tiling types and the SMEM fit are in `_grouped_tiles.py`; this module only chooses among them.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels._grouped_tiles import GemmTiling, GroupedGemmTuning, fit_tiling, fit_wgrad_tiling

__all__ = ["default_tuning", "default_kernel_tuning", "SMALL_GROUP_ROWS", "PINGPONG_MAX_REDUCTION",
           "PINGPONG_WIDE_OUTPUT", "PINGPONG_WIDE_OUTPUT_DEVICES",
           "PINGPONG_WGRAD_MAX_ROWS", "PINGPONG_WGRAD_MAX_ROWS_NARROW", "NARROW_HIDDEN", "PINGPONG_TILING"]


def default_tuning(m: int, k: int, n: int, num_groups: int, pingpong: bool = True,
                   device_kind: str | None = None) -> GroupedGemmTuning:
    """Defaults by shape: the widest CTA tile that divides the output (forward writes N columns, dgrad
    K columns, wgrad K x N), with the forward's pipelines chained across work items. Measured
    on the H200, each against the alternatives in one run (benchmarks/results/grouped_gemm_sweep_h200.json,
    grouped_gemm_chain_sweep_h200.json):
      * the forward of large experts (K >= 4096, N >= 2048: Mixtral, DeepSeek-V3) takes 128-wide K steps two
        deep: 677 vs 650 TFLOP/s (Mixtral 8x7B), 676 vs 651 (DeepSeek-V3 EP 8) against 64-wide four deep;
      * chained pipelines: +0.1..2.3% forward on all 8 (shape, routing) pairs timed (DeepSeekMoE 628 vs 614,
        Mixtral with 128-wide steps 680 vs 666, Qwen3 575 vs 571); chained with two epilogue slots was slower
        (478), so epi_slots stays 1;
      * on the fine-grained shapes (K = 2048, N <= 1408) no swept tiling beat these by more than ~2%;
      * the input gradient follows the same rule with its own roles (it reduces over N and writes K columns):
        Mixtral's gate/up dgrad (reduction 14336) 708 vs 690 TFLOP/s with 128-wide steps, DeepSeek-V3's
        (reduction 2048, below the rule) 661 vs 659, Qwen3's (768) 567 vs 616 (grouped_gemm_backward_sweep_h200.json);
        chained dgrad items measured within 1.6% either way (690.6 / 626.3 / 658.2 vs 690.4 / 615.8 / 659.2): off;
      * few rows per group (M / G <= SMALL_GROUP_ROWS) where the output width falls back to 256-row CTAs: 128-row
        CTAs instead (`_rows_for_small_groups`);
      * short reductions (<= PINGPONG_MAX_REDUCTION) take the ping-pong schedule (`_pingpong_for_short_reductions`),
        and so does the weight gradient of small groups (`_pingpong_wgrad_for_small_groups`).
    `pingpong=False` keeps the cooperative schedule everywhere: the fused exchange kernels, whose hooks need it.
    `device_kind` (jax's `device_kind`; None: the default device's) matters only to `_pingpong_for_short_reductions`."""
    device_kind = current_device_kind() if device_kind is None else device_kind
    rows_per_group = m / max(num_groups, 1)
    fwd = _long_reduction_steps(fit_tiling(GemmTiling(chain_items=True), n, "N"), reduction=k, out_cols=n)
    dgrad = _long_reduction_steps(fit_tiling(GemmTiling(), k, "K"), reduction=n, out_cols=k)
    wgrad = _chained_wgrad_where_measured(fit_wgrad_tiling(GemmTiling(), k, n))
    fwd, dgrad = _rows_for_small_groups(fwd, n, rows_per_group), _rows_for_small_groups(dgrad, k, rows_per_group)
    if pingpong:
        fwd = _pingpong_for_short_reductions(fwd, k, n, device_kind)
        dgrad = _pingpong_for_short_reductions(dgrad, n, k, device_kind)
        wgrad = _pingpong_wgrad_for_small_groups(wgrad, k, n, rows_per_group)
    return GroupedGemmTuning(fwd=fwd, dgrad=dgrad, wgrad=wgrad)


# The ping-pong schedule (each compute warpgroup on its own 128 x 128 tiles, 64-wide K steps six deep) against
# the cooperative tiles above, forward and input gradient, in one run on the H200
# (benchmarks/results/grouped_gemm_pingpong_h200.json): it wins where the reduction is short, so that the
# epilogue it hides is a large share of a work item: forward DeepSeekMoE EP1 (K 2048) 620 vs 582 TFLOP/s, Qwen3
# EP8 (K 2048) 628 vs 581, EP1 558 vs 550; the input gradients over N = 1408 / 768 / 2048 (DeepSeekMoE, Qwen3,
# DeepSeek-V3) likewise. It loses where the reduction is long (its tile reads 1.5x the bytes per FLOP of the
# 128 x 256 CTA): forward Mixtral (K 4096) 626 vs 663, DeepSeek-V3 (K 7168) 644 vs 661, 8x22B (K 6144) 658
# vs 674; Mixtral's input gradient (reduction 14336) within 1.3%.
PINGPONG_MAX_REDUCTION = 2048
# Output width matters on the H100 (989 TFLOP/s over 3.35 TB/s of HBM against the H200's 4.8): DeepSeek-V3 EP8's
# input gradient (reduction 2048, 7168 output columns), fwd+bwd of the table's four routings, in one run each
# card: H200 ping-pong +0.3..1.6% (grouped_gemm_table_abba_h200.json); H100 cooperative 668 / 634 / 654 / 623
# vs ping-pong 612 / 586 / 596 / 579 TFLOP/s, torch 661 / 615 / 652 / 627, and wider ping-pong bands of 16 / 32
# row tiles did not recover it (600 / 572 / 585 / 574, 585 / 546 / 587 / 574; grouped_gemm_dsv3_bands_h100.json).
# The narrow fine-grained shapes keep ping-pong on the H100 (DeepSeekMoE EP8, 2048 columns: 620.9 vs 601.9,
# grouped_gemm_dsv3_schedules_h100.json). So an output wider than PINGPONG_WIDE_OUTPUT takes ping-pong only on
# the cards named in PINGPONG_WIDE_OUTPUT_DEVICES; other cards (untimed ones too) keep the cooperative tiles.
PINGPONG_WIDE_OUTPUT = 4096
PINGPONG_WIDE_OUTPUT_DEVICES = ("NVIDIA H200",)   # jax's device_kind prefix; not "NVIDIA GH200" (untimed)
PINGPONG_TILING = GemmTiling(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=6, schedule="pingpong")


# The weight gradient reduces over a group's rows. Its ping-pong schedule (128 x 128 dw tiles per warpgroup,
# six stages) vs the cooperative tiles, fwd+bwd (benchmarks/results/grouped_gemm_pingpong_wgrad_h200.json,
# grouped_gemm_wgrad_rows_*_h200.json; each pair in one set of rounds):
#   rows per group    DeepSeekMoE (K 2048)   Qwen3 (K 2048)   DeepSeek-V3 (K 7168)   Mixtral (K 4096)
#   512 / 768           +4.6%                  +5.2%
#   1024                                       -1.1% (both sides the same ping-pong kernel: noise)
#   1536                +4.9%, +3.8%           +6.0%            +0.9%                  -3.5%
#   2048                                       +2.4%            -4.0%                  -3.0%
#   3072                -1.3%                                   -4.7%                  -5.9%
# so it is taken for groups of <= 1024 rows, and of <= 2048 where the hidden size (K) is <= 2048 (narrow
# fine-grained models, whose dw tiles are few per group). The rounds' same-kernel spread was 0.5-5% on these
# runs, so the threshold is coarse. M / G is the buffer's rows per group (an upper bound of the routed rows).
PINGPONG_WGRAD_MAX_ROWS = 1024
PINGPONG_WGRAD_MAX_ROWS_NARROW, NARROW_HIDDEN = 2048, 2048
# Where the weight gradient stays cooperative it runs its items on one SMEM ring (chain_items: the next item's
# token blocks load while this item's tile is stored, `_pingpong_body.ring_weight_grad_kernel`). Against the
# unchained cooperative kernel, the wgrad call alone in one set of rounds
# (benchmarks/results/probe_ncu_wgrad_chained_h200.json): Mixtral 8x7B EP1 (2048 rows per group, K 4096)
# 657 vs 635 TFLOP/s, DeepSeek-V3 EP8 (2048 rows, K 7168) 646 vs 628; Nsight Compute: 0.884 vs 0.865 of the
# MMA-bound cycles on both. Where groups are small the ping-pong schedule still beats it (Qwen3 EP1, 512 rows:
# 510 vs 501; DeepSeekMoE EP1, 768 rows: 576 vs 550), so the rule above is unchanged. Only the tiles it was
# timed on take it: 128 x 128 per warpgroup, stacked along M (CTA 256 x 128). The side-by-side split (K a
# multiple of 128 but not 256, e.g. DeepSeekMoE's down projection, K 1408) passed its GPU tests on the ring
# but was not timed, and the 64-wide fallbacks ran only in the interpreter: both keep jax's pipelines.


def _chained_wgrad_where_measured(cfg: GemmTiling) -> GemmTiling:
    measured = (cfg.tile_m, cfg.tile_n, cfg.wg_split, cfg.schedule) == (128, 128, "m", "cooperative")
    return dataclasses.replace(cfg, chain_items=True) if measured else cfg


def _pingpong_wgrad_for_small_groups(cfg: GemmTiling, k: int, n: int, rows_per_group: float) -> GemmTiling:
    """The weight gradient's ping-pong tiles where groups hold <= PINGPONG_WGRAD_MAX_ROWS rows (or
    <= PINGPONG_WGRAD_MAX_ROWS_NARROW with K <= NARROW_HIDDEN) and K and N are multiples of 128; else `cfg`."""
    tile = PINGPONG_TILING
    limit = PINGPONG_WGRAD_MAX_ROWS_NARROW if k <= NARROW_HIDDEN else PINGPONG_WGRAD_MAX_ROWS
    if rows_per_group <= limit and k % tile.tile_m == 0 and n % tile.tile_n == 0:
        return tile
    return cfg


def current_device_kind() -> str:
    import jax
    return jax.devices()[0].device_kind


def _pingpong_for_short_reductions(cfg: GemmTiling, reduction: int, out_cols: int, device_kind: str) -> GemmTiling:
    """The ping-pong tiles for a forward / input gradient whose reduction is <= PINGPONG_MAX_REDUCTION and whose
    output width is a multiple of 128 (and <= PINGPONG_WIDE_OUTPUT but on PINGPONG_WIDE_OUTPUT_DEVICES); else
    `cfg` unchanged."""
    wide_ok = out_cols <= PINGPONG_WIDE_OUTPUT or device_kind.startswith(PINGPONG_WIDE_OUTPUT_DEVICES)
    if reduction <= PINGPONG_MAX_REDUCTION and out_cols % PINGPONG_TILING.tile_n == 0 \
            and reduction % PINGPONG_TILING.tile_k == 0 and wide_ok:
        return PINGPONG_TILING
    return cfg


# A group's last row tile is partly empty: about half a CTA tile of wasted rows per group on average. An output
# width that is not a multiple of 256 (DeepSeekMoE's 1408) falls back to warpgroups stacked along M (CTA
# 256 x 128), which wastes 128 rows per group where 128-row CTAs waste 64 but run ~4% slower per row on full
# tiles (uniform DeepSeekMoE EP1, 768 rows per group: 612 vs 590 TFLOP/s). Break-even: 0.04 M = 61 G rows,
# M / G ~ 1536. M / G is the buffer's rows per group, an upper bound of the routed rows (an EP receive
# buffer's tail makes it larger): measured in benchmarks/results/grouped_gemm_small_groups_h200.json.
SMALL_GROUP_ROWS = 1536


def _rows_for_small_groups(cfg: GemmTiling, out_cols: int, rows_per_group: float) -> GemmTiling:
    """128-row CTAs (two 128 x 64 warpgroup tiles side by side) instead of 256-row ones for few rows per group."""
    if cfg.cta_m == 256 and rows_per_group <= SMALL_GROUP_ROWS and out_cols % 128 == 0:
        return dataclasses.replace(cfg, wg_split="n", tile_n=64, epi_tile_n=64)
    return cfg


def _long_reduction_steps(cfg: GemmTiling, reduction: int, out_cols: int) -> GemmTiling:
    """128-wide K steps two deep for large experts (reduction >= 4096, >= 2048 output columns, side-by-side
    warpgroups): the forward and input-gradient rule of `default_tuning`."""
    if reduction >= 4096 and out_cols >= 2048 and reduction % 128 == 0 and cfg.wg_split == "n":
        return dataclasses.replace(cfg, tile_k=128, max_concurrent_steps=2)
    return cfg


def default_kernel_tuning(kernel: str, k: int, n: int, m: int | None = None,
                          num_groups: int | None = None, device_kind: str | None = None) -> GroupedGemmTuning:
    """`default_tuning`'s tiles for `kernel` ('dgrad' or 'wgrad') called on its own, so that the other
    kernels' alignment rules do not reject shapes this one takes (dgrad alone needs only K to fit)."""
    if kernel == "dgrad":
        fit = _long_reduction_steps(fit_tiling(GemmTiling(), k, "K"), reduction=n, out_cols=k)
        if m is not None and num_groups:
            fit = _rows_for_small_groups(fit, k, m / num_groups)
        fit = _pingpong_for_short_reductions(fit, reduction=n, out_cols=k,
                                             device_kind=current_device_kind() if device_kind is None else device_kind)
    else:
        fit = _chained_wgrad_where_measured(fit_wgrad_tiling(GemmTiling(), k, n))
        if m is not None and num_groups:
            fit = _pingpong_wgrad_for_small_groups(fit, k, n, m / num_groups)
    return dataclasses.replace(GroupedGemmTuning(), **{kernel: fit})
