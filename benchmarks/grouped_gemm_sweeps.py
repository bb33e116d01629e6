"""The forward tilings and backward-kernel variants bench_grouped_gemm.py --sweep times against the default
tuning, in grouped_gemm_jax_timing.measure_case (each variant's output checked against the default's)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._default_tuning import PINGPONG_TILING
from pallas_kernels.grouped_gemm import GemmTiling, grouped_gemm_dgrad, grouped_gemm_wgrad


def sweep_backward(row, x, w, dy, gs, base, flops, record, args):
    """The input- and weight-gradient kernels alone, default tiles against variants (128-wide K steps, for
    the weight gradient 128 tokens per step; chained items or not; pipeline depth; warpgroup split); each variant's
    output is compared with the default's (relative Frobenius error, in row['errors'])."""
    dgrad_variants = [dict(), dict(chain_items=True), dict(tile_k=128, max_concurrent_steps=2),
                      dict(tile_k=128, max_concurrent_steps=2, chain_items=True)]
    # the default's cooperative weight gradient runs on one ring across items (chain_items); unchained is the
    # jax-pipeline kernel it replaced
    wgrad_variants = [dict(), dict(chain_items=False), dict(max_concurrent_steps=3),
                      dict(tile_k=128, max_concurrent_steps=2), dict(wg_split="n")]
    dyb = dy.astype(x.dtype)
    for kernel, variants in (("dgrad", dgrad_variants), ("wgrad", wgrad_variants)):
        ref, seen = None, set()
        for v in variants:
            cfg = dataclasses.replace(getattr(base, kernel), **v)
            if cfg in seen:   # e.g. chain_items=False where the default is not chained: timed once
                continue
            seen.add(cfg)
            if kernel == "dgrad" and (x.shape[1] % cfg.cta_n or w.shape[2] % cfg.tile_k):
                continue
            tuning = dataclasses.replace(base, **{kernel: cfg})
            if kernel == "dgrad":
                f = jax.jit(lambda dy, w, gs, t=tuning: grouped_gemm_dgrad(dy, w, gs, tuning=t,
                                                                           interpret=args.interpret))
                argv = (dyb, w, gs)
            else:
                f = jax.jit(lambda x, dy, gs, t=tuning: grouped_gemm_wgrad(x, dy, gs, tuning=t,
                                                                           interpret=args.interpret))
                argv = (x, dyb, gs)
            label = f"ours_{kernel}[{tiling_label(cfg)}]/{kernel}"
            record(label, f, argv, flops, do_check=False)
            if label not in row["tflops"] or row["tflops"][label] is None:
                continue
            out = np.asarray(f(*argv).astype(jnp.float32))
            if ref is None:
                ref = out
            err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
            row["errors"][label] = err
            print(f"    {label}: rel diff to the default {err:.1e}", flush=True)


def tiling_label(cfg):
    if cfg.schedule == "pingpong":   # wg_split, epilogue staging and chaining do not apply to it
        return (f"pp{cfg.tile_m}x{cfg.tile_n}k{cfg.tile_k}s{cfg.max_concurrent_steps}"
                f"m{cfg.grid_minor}w{cfg.grid_tile_width}")
    return (f"{cfg.wg_split}{cfg.tile_m}x{cfg.tile_n}k{cfg.tile_k}s{cfg.max_concurrent_steps}"
            f"m{cfg.grid_minor}w{cfg.grid_tile_width}e{cfg.epi_tile_n}x{cfg.epi_slots}"
            f"{'c' if cfg.chain_items else ''}{f'sk{cfg.split_k}' if cfg.split_k > 1 else ''}")


def sweep_tilings(n, k):
    """Forward tilings to time against the default: warpgroup split, tile sizes, K step, pipeline depth,
    work order, epilogue staging (chunk width and slots), chained pipelines across work items. Only those
    that tile N and K exactly."""
    variants = [dict(), dict(epi_slots=2), dict(chain_items=True), dict(chain_items=True, epi_slots=2),
                dict(chain_items=True, grid_tile_width=16), dict(chain_items=True, wg_split="m"),
                dict(chain_items=True, tile_k=128, max_concurrent_steps=2),
                dict(tile_k=128, max_concurrent_steps=2), dict(wg_split="m"), dict(wg_split="m", epi_slots=2),
                dict(grid_minor=1), dict(tile_n=64, max_concurrent_steps=6, epi_slots=2),
                # one m64n256 wgmma per K slice per warpgroup (CTA 128 x 256, as cuBLAS's 256x128-class tiles):
                # both warpgroups read the same 256-wide w slice, 17% less SMEM read than two m64n128 each
                dict(wg_split="m", tile_m=64, tile_n=256), dict(wg_split="m", tile_m=64, tile_n=256, chain_items=True),
                dict(wg_split="m", tile_m=64, tile_n=256, tile_k=128, max_concurrent_steps=2),
                dict(wg_split="m", tile_m=64, tile_n=256, tile_k=128, max_concurrent_steps=2, chain_items=True),
                # 128-row CTAs (128 x 128: two m64n128 warpgroups, or two m128n64 side by side): half the
                # rows of the 256-row tiles that N = 1408 (DeepSeekMoE) falls back to, for groups of few rows
                dict(wg_split="m", tile_m=64, chain_items=True), dict(tile_n=64, chain_items=True),
                # the reduction split in 2 / 4 (fp32 partials, summed after): more items where tiles are few
                dict(split_k=2, chain_items=True), dict(split_k=4, chain_items=True)]
    # the ping-pong schedule (the default for reductions <= 2048): its ring's depth and its work order (each
    # warpgroup takes alternate items, so the snake's band width decides which w tiles two SMs share in L2);
    # 6 stages of 32 KB are the most that fit beside the epilogue's SMEM
    pingpong = [dict(), dict(max_concurrent_steps=4), dict(max_concurrent_steps=5),
                dict(grid_tile_width=4), dict(grid_tile_width=16), dict(grid_minor=1)]
    out = []
    for cfg in [GemmTiling(**v) for v in variants] + [dataclasses.replace(PINGPONG_TILING, **v) for v in pingpong]:
        if n % cfg.cta_n == 0 and k % (cfg.tile_k * cfg.split_k) == 0:
            out.append(cfg)
    return out
