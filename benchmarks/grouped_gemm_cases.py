"""The cases bench_grouped_gemm.py runs: shapes (the goal shapes, the paper's models, issue 10's table, the CPU
smoke set), the routings that give each its group sizes, the implementations each suite times, and the --list
plan with its rough run-time estimate. numpy only: --list needs no device."""
import numpy as np

GOAL_SHAPES = {"goal_mixtral": (32768, 4096, 14336, 8), "goal_fine_grained": (8192, 4096, 1408, 16)}
# (hidden, ffn, experts, top_k) as published; M = 8192 * top_k, G = experts // 8
MODELS = {"internal_352b": (4096, 14336, 32, 3), "mixtral_8x7b": (4096, 14336, 8, 2),
          "mixtral_8x22b": (6144, 16384, 8, 2), "phi_3_5_moe": (4096, 6400, 16, 2),
          "deepseekmoe_16b": (2048, 1408, 64, 6), "hunyuan_large": (6400, 18304, 16, 1)}
TABLE_ROUTINGS = ("uniform", "skewed", "half_empty", "padded")   # the table's rows
# "random": a balanced router's group sizes (multinomial, equal probabilities, fixed seed): sizes that are
# not tile multiples, as real routing gives (uniform's M / G is often an exact multiple of the row tile)
ROUTINGS = TABLE_ROUTINGS + ("random",)

# ---------------------------------------------------------------------------------------------------
# Issue 10's table. Expert up-projection per device: x [M, K=hidden] @ w [G, K, N=expert FFN].
#   rows per device  M = tokens_per_device * top_k   (the EP all-to-all exchanges the routed copies of
#                        the tokens between devices and conserves their number, so at uniform routing
#                        every device receives T * top_k rows on average, for any EP)
#   local experts    G = experts / EP
# with T = 8192 tokens per device unless a row says otherwise.
# ---------------------------------------------------------------------------------------------------
TOKENS_PER_DEVICE = 8192
ISSUE10_MODELS = {  # (hidden K, expert FFN N, routed experts E, top_k)
    "mixtral_8x7b": (4096, 14336, 8, 2),
    "mixtral_8x22b": (6144, 16384, 8, 2),
    "deepseekmoe_16b": (2048, 1408, 64, 6),
    "qwen3_30b_a3b": (2048, 768, 128, 8),      # "Qwen3-30B-A3B-like" as the issue gives it
    "deepseek_v3": (7168, 2048, 256, 8),       # routed experts only (the shared expert is a dense GEMM)
}
# (model, EP, routings, tokens per device), in the order run. Every row gets uniform; skewed / half_empty /
# padded go to the three rows the issue's cases matter most for (Mixtral EP1, Qwen3 EP1, DeepSeek-V3 EP8),
# padded also to the other EP8 rows (the dropless receive buffer exists only with EP > 1) since its dense
# baseline is shared with the EP1 row. The last two rows go beyond the issue's minimum (EP8 for every
# model); --time-budget-s cuts them first.
ISSUE10_ROWS = [
    ("mixtral_8x7b", 1, TABLE_ROUTINGS, TOKENS_PER_DEVICE),
    ("mixtral_8x7b", 8, ("uniform", "padded"), TOKENS_PER_DEVICE),
    ("mixtral_8x22b", 1, ("uniform",), TOKENS_PER_DEVICE),
    ("deepseekmoe_16b", 1, ("uniform",), TOKENS_PER_DEVICE),
    ("qwen3_30b_a3b", 1, TABLE_ROUTINGS, TOKENS_PER_DEVICE),
    ("qwen3_30b_a3b", 8, ("uniform", "padded"), TOKENS_PER_DEVICE),
    ("deepseek_v3", 8, TABLE_ROUTINGS, TOKENS_PER_DEVICE),
    ("mixtral_8x22b", 8, ("uniform",), TOKENS_PER_DEVICE),
    ("deepseekmoe_16b", 8, ("uniform",), TOKENS_PER_DEVICE),
]
# Estimated run time of `--suite issue10 --torch` on one H200 (compile costs guessed, not measured; every
# timing is one untimed + 6 timed loops of >= 0.15 s): 20 cases over 9 shapes; 80 timings of ours and
# ours_grid_tiles (fwd, fwd+bwd) + 20 of ours_repeat/fwd (the rounds' noise control) + 16 of the dense GEMM
# (once per distinct (rows, K, N): 8 of them) + 40 of torch (+ its 16 dense).
#   JAX start ~10 s; torch server (import, CUDA start) ~20 s, its 56 timings x ~1 s inside the rounds;
#   compiles: ours 2 x 9 shapes x (fwd ~2 s + fwd+bwd ~4 s) + dense 8 x (~1 + ~2 s) ~130 s;
#   timed loops 116 x ~1 s; data + sampled checks 9 shapes x ~2 s + 20 cases x ~0.5 s ~30 s.
#   Total ~5-6 min (`--list` prints the same rough model); --time-budget-s starts no new timing past its limit,
#   so the JSON and the table are written even if compiles are much slower than guessed. Measured
#   2026-12-04 with ours, ours_unwritten_tail, dense and torch (grouped_gemm_table_abba_h200.json): 378 s.
UNWRITTEN_TAIL = "ours_unwritten_tail"   # ours with torch._grouped_mm's tail contract (zero_tail='none')
REPEAT = "ours_repeat"   # ours/fwd timed a second time in the same rounds: the rounds' noise on one kernel
SAME_TAIL_VERDICT = "ours>=torch_grouped_mm_same_tail_contract"
SUITES = {"issue10": dict(impls=("ours", "ours_grid_tiles", UNWRITTEN_TAIL, "dense_same_flops")),
          "tiny": dict(impls=("ours", "dense_same_flops"))}
# CPU smoke of the whole pipeline (interpret mode): tiny shapes, every routing, tile-aligned K and N
TINY_ROWS = {"tiny_g4": (512, 128, 256, 4), "tiny_g1": (256, 128, 256, 1)}


def model_shapes():
    return {name: (8192 * k, h, f, max(e // 8, 1)) for name, (h, f, e, k) in MODELS.items()}


def group_sizes_for(m, g, routing):
    """Rows per group (numpy int32, sorted-by-group layout) for M rows over G groups."""
    if routing == "padded":  # an expert-parallel dropless receive buffer at n = 2: half the rows are the tail
        sizes = np.full(g, (m // 2) // g)
        sizes[-1] += m // 2 - sizes.sum()
        return sizes.astype(np.int32)
    if routing == "half_empty" and g > 1:  # groups 1, 3, 5, ... get nothing, the others split M evenly
        full = np.arange(g) % 2 == 0
        sizes = np.where(full, m // int(full.sum()), 0)
        sizes[np.flatnonzero(full)[-1]] += m - sizes.sum()
        return sizes.astype(np.int32)
    if routing == "random" and g > 1:
        return np.random.default_rng(0).multinomial(m, np.full(g, 1.0 / g)).astype(np.int32)
    if routing == "uniform" or g == 1:
        sizes = np.full(g, m // g)
    elif routing == "skewed":
        big = int(0.4 * m)
        sizes = np.full(g, (m - big) // (g - 1))
        sizes[0] = big
    else:
        raise ValueError(f"unknown routing {routing!r}; choose from {ROUTINGS}")
    sizes[-1] += m - sizes.sum()
    return sizes.astype(np.int32)


def routing_applies(routing, g):
    return g > 1 or routing in ("uniform", "padded")   # skewed / half_empty / random need two groups


def make_case(shape, m, k, n, g, routing, **extra):
    sizes = group_sizes_for(m, g, routing)
    return dict(shape=shape, routing=routing, **extra, M=m, K=k, N=n, G=g, group_sizes=sizes.tolist(),
                useful_rows=int(min(int(sizes.sum()), m)))


def build_cases(args):
    """The list of (shape, routing) cases, in the order run; no device needed."""
    routings_arg = args.routings.split(",") if args.routings else None
    for r in routings_arg or ():
        if r not in ROUTINGS:
            raise SystemExit(f"--routings: unknown routing {r!r}; choose from {ROUTINGS}")
    cases = []
    if args.suite == "issue10":
        for model, ep, routings, tokens in ISSUE10_ROWS:
            tokens = getattr(args, "tokens_per_device", None) or tokens
            k, n, e, top_k = ISSUE10_MODELS[model]
            m, g = tokens * top_k, e // ep
            for routing in routings_arg or routings:
                if routing_applies(routing, g):
                    cases.append(make_case(f"{model}_ep{ep}", m, k, n, g, routing, model=model, ep=ep,
                                           tokens_per_device=tokens, top_k=top_k, experts=e))
    else:
        if args.suite == "tiny":
            shapes, default_routings = dict(TINY_ROWS), list(ROUTINGS)
        elif args.mode == "smoke":
            shapes, default_routings = dict(GOAL_SHAPES), ["uniform"]
        else:
            shapes, default_routings = {**GOAL_SHAPES, **model_shapes()}, ["uniform", "skewed"]
        for name, (m, k, n, g) in shapes.items():
            for routing in routings_arg or default_routings:
                if routing_applies(routing, g):
                    cases.append(make_case(name, m, k, n, g, routing))
    if args.only:  # in the order given (a run cut by a time limit then has the first ones)
        names = args.only.split(",")
        known = list(dict.fromkeys(c["shape"] for c in cases))
        unknown = [s for s in names if s not in known]
        if unknown:
            raise SystemExit(f"--only: unknown shapes {unknown}; choose from {known} (--mode full or --suite "
                             "for others)")
        cases = [c for s in names for c in cases if c["shape"] == s]
    return cases


def rle(sizes):
    """[4096, 4096, 0, 5] -> '2x4096,0,5'; [1024, 0, 1024, 0] -> '2x(1024,0)'."""
    if len(sizes) >= 4 and len(sizes) % 2 == 0 and len(set(sizes[0::2])) == 1 and len(set(sizes[1::2])) == 1 \
            and sizes[0] != sizes[1]:
        return f"{len(sizes) // 2}x({sizes[0]},{sizes[1]})"
    out = []
    for v in sizes:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return ",".join(f"{c}x{v}" if c > 1 else str(v) for v, c in out)


def wanted(label, args):
    """Whether to time an implementation label ('ours/fwd', 'jax_ragged_dot_mgpu[4]/fwd', ...)."""
    if args.impl_filter:
        return any(s in label for s in args.impl_filter)
    base = label.split("/")[0].split("[")[0]
    if args.suite:
        return base in SUITES[args.suite]["impls"]
    return not (base == "xla_ragged_dot" and args.mode == "smoke")


def print_cases(cases, args):
    print(f"{len(cases)} cases ({len({c['shape'] for c in cases})} shapes), in the order run:")
    print(f"{'#':>3} {'shape':20s} {'routing':10s} {'M':>6} {'K':>5} {'N':>6} {'G':>4} {'useful':>6} "
          f"{'GFLOP/GEMM':>10}  group sizes")
    for i, c in enumerate(cases):
        print(f"{i:3d} {c['shape']:20s} {c['routing']:10s} {c['M']:6d} {c['K']:5d} {c['N']:6d} {c['G']:4d} "
              f"{c['useful_rows']:6d} {2 * c['useful_rows'] * c['K'] * c['N'] / 1e9:10.1f}  {rle(c['group_sizes'])}")
    grouped = [b for b in ("ours", "ours_grid_tiles", "ours_mask_tail", "ours_unwritten_tail", "ours_scan_tables",
                           "xla_ragged_dot")
               if wanted(f"{b}/fwd", args)]
    kinds = 2 if args.bwd else 1
    n_grouped = len(cases) * len(grouped) * kinds + (len(cases) if "ours" in grouped else 0)   # + ours_repeat
    dense_keys = {(c["useful_rows"], c["K"], c["N"]) for c in cases} if wanted("dense_same_flops/fwd", args) else set()
    n_shapes = len({c["shape"] for c in cases})
    print(f"timings: {n_grouped} grouped ({'+'.join(grouped) or 'none'}, fwd{' and fwd+bwd' if args.bwd else ''})"
          f" + {len(dense_keys) * kinds} dense ({len(dense_keys)} distinct (rows, K, N))"
          f" + {2 * len(cases) if args.torch else 0} torch")
    # rough model, compile costs guessed (not measured): see the estimate next to ISSUE10_ROWS
    est = (10 + (20 + 1.0 * len(cases) if args.torch else 0) + n_shapes * len(grouped) * (2 + 4 * (kinds - 1))
           + len(dense_keys) * (1 + 2 * (kinds - 1)) + 1.0 * (n_grouped + len(dense_keys) * kinds)
           + 2 * n_shapes + 0.5 * len(cases))
    print(f"rough GPU time estimate: {est / 60:.1f} min (guessed compile costs; real H200 run may differ)")
