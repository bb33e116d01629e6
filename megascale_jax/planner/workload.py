"""What one layer asks of one device: GEMMs, attention FLOPs, elementwise bytes, collectives, activations.

Counted per device for one microbatch of `T` tokens in the intra-node group of `n` devices (T = b*s).
Layouts (attention x FFN): sp = Ulysses sequence parallel (weights replicated, sequence sharded), tp =
Megatron tensor parallel with sequence-sharded norms (all-gather in, reduce-scatter out), ep = whole
experts per device, rep/xla = the XLA-propagation plan (attention replicated, experts sharded, expert
intermediates all-reduced in fp32 -- what analyze_plans found the partitioner does).

Communication bytes are the closed forms that `megascale_jax.analyze.closed_forms` checks against
compiled HLO (SP uses the derived (2+2/m)*bsh*(n-1)/n^2, half the paper's printed form), or
`expert_parallel_wire_bytes` for this code's padded dropless buffers. Elementwise traffic is a count of
the tensors each fused elementwise op reads and writes (listed in `elementwise_elements`), in bf16.
"""
from __future__ import annotations

import dataclasses

from megascale_jax.parallel.expert_parallel import expert_parallel_wire_bytes

RECIPES = {"megascale": ("sp", "ep"), "megatron_tp": ("tp", "tp"), "tp_ep": ("tp", "ep"),
           "sp_tp": ("sp", "tp"), "xla": ("rep", "xla")}
BF16 = 2
# Bytes of elementwise HBM traffic per parameter per optimizer step in this code (fp32 master weights):
# bf16 cast for compute 6 (read 4 + write 2), wgrad cast to fp32 6, gradient add into the fp32 accumulator
# 12, global-norm clip 4, AdamW 28 (read p, g, m, v; write p, m, v; ZeRO-1 shards this part, and bfloat16
# moments make it 20: `systems.System.adamw_bytes`).
ADAMW_BYTES_PER_PARAM = 28
OPTIMIZER_BYTES_PER_PARAM = 28 + ADAMW_BYTES_PER_PARAM
# Loss: fp32 upcast of the bf16 logits (2 + 4), logsumexp read (4), softmax gradient read + write (4 + 4),
# cast back to bf16 (2) -> bytes per token per vocabulary entry.
LOSS_BYTES_PER_LOGIT = 20


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    layers: int
    dense_layers: int
    h: int
    heads: int
    kv_heads: int
    dense_ffn: int
    experts: int
    top_k: int
    f: int
    shared: int
    shared_f: int
    seq: int
    tied: bool
    head_dim: int = 0        # 0 = h / heads (configs resolve it; Qwen3-MoE has heads x head_dim != hidden)

    @classmethod
    def from_config(cls, cfg, seq_len: int | None = None) -> "Shape":
        m, e = cfg.model, cfg.model.moe
        return cls(cfg.name, m.vocab_size, m.num_layers, m.num_dense_layers, m.hidden, m.num_heads,
                   m.num_kv_heads, m.dense_ffn, e.num_experts, e.top_k, e.expert_ffn, e.num_shared_experts,
                   e.shared_expert_ffn or e.expert_ffn, seq_len or cfg.train.seq_len, m.tie_embeddings,
                   getattr(m, "head_dim", 0) or m.hidden // m.num_heads)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def gqa(self) -> float:
        return self.heads / self.kv_heads

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.h // self.heads)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.h // self.heads)


@dataclasses.dataclass(frozen=True)
class Gemm:
    name: str
    flops: float            # forward FLOPs on this device (backward = 2x, dgrad + wgrad)
    grouped: bool
    rows_per_group: float   # M (dense) or M / G (grouped)
    k: int
    n: int
    tail_rows_frac: float = 0.0   # padded rows past sum(group_sizes) / real rows (fwd and dgrad stream them)
    remat: tuple = ("full",)      # remat levels that recompute this GEMM in the backward
    groups: int = 1


@dataclasses.dataclass(frozen=True)
class Comm:
    name: str
    bytes: float            # forward wire bytes one device sends; the backward sends as many
    kind: str               # a2a | ag | rs | ar
    remat: tuple = ("full",)
    calls: int = 1          # collective ops it takes (each pays the per-call latency)


@dataclasses.dataclass(frozen=True)
class LayerWork:
    gemms: tuple
    attn_flops: float       # forward attention-core FLOPs on this device
    ew_fwd: float           # elementwise bytes, forward
    ew_bwd: float           # elementwise bytes, backward
    comms: tuple
    act_units: dict         # remat -> saved activation elements in units of T*h/n


def _ep_rows(sh: Shape, T: int, n: int, padded: bool) -> tuple[float, float]:
    """(real rows, padded rows) of the expert buffer on one device."""
    real = T * sh.top_k / n
    if not padded or n == 1:
        return real, real
    return real, T * min(sh.top_k, sh.experts // n)


def attention_work(sh: Shape, layout: str, T: int, n: int):
    """GEMMs, core FLOPs, (fwd, bwd) elementwise elements per device, comms, activation units."""
    # q = heads x head_dim, kv = kv_heads x head_dim (= h and h/m when head_dim = h / heads, the paper's case)
    h, q, kv = sh.h, sh.q_dim, sh.kv_dim
    qkv = q + 2 * kv
    core = T * 2 * sh.seq * q / (1 if layout == "rep" else n)   # causal: 2*S*H*d per token, heads over n
    # activation units (of T*h/n elements): layer input, norm out, q, k (roped), qkv, core out...; with q = h,
    # kv = h/m these are the counts 5 + 2/m (SP) and 3 + 2/m + n (TP) of this code's saved tensors
    qkv_units = 1 + 2 * q / h + 2 * kv / h
    if layout == "sp":
        gemms = [Gemm("qkv", 2 * T / n * h * qkv, False, T / n, h, qkv),
                 Gemm("o", 2 * T / n * q * h, False, T / n, q, h)]
        # q, k, v in and the core's output back: (2 + 2/m) * T*h*(n-1)/n^2 at q = h (workload docstring)
        comms = [Comm("sp_a2a", (2 * q + 2 * kv) * T * (n - 1) / n ** 2 * BF16, "a2a", ("full",), 4)]
        units = 2 + qkv_units
    elif layout == "tp":
        gemms = [Gemm("qkv", 2 * T * h * qkv / n, False, T, h, qkv // n),
                 Gemm("o", 2 * T * q * h / n, False, T, q // n, h)]
        comms = [Comm("tp_ag", T * h * (n - 1) / n * BF16, "ag"), Comm("tp_rs", T * h * (n - 1) / n * BF16, "rs")]
        units = qkv_units + n
    else:
        gemms = [Gemm("qkv", 2 * T * h * qkv, False, T, h, qkv),
                 Gemm("o", 2 * T * q * h, False, T, q, h)]
        comms, units = [], (2 + qkv_units) * n
    tok = T if layout == "rep" else T / n
    # norm 2h / 3h, residual 3h / 3h, RoPE on q and k 2(q + kv) each way
    ew = (tok * (5 * h + 2 * q + 2 * kv), tok * (6 * h + 2 * q + 2 * kv))
    return gemms, core, ew, comms, units


def _swiglu_gemms(prefix, rows, groups, h, width, grouped, tail, remat_up=("full", "selective")):
    flops = 2 * rows * h * width
    rpg = rows / groups
    return [Gemm(prefix + "gate", flops, grouped, rpg, h, width, tail, remat_up, groups),
            Gemm(prefix + "up", flops, grouped, rpg, h, width, tail, remat_up, groups),
            Gemm(prefix + "down", flops, grouped, rpg, width, h, tail, ("full",), groups)]


def moe_ffn_work(sh: Shape, layout: str, T: int, n: int, dispatch: str, padded: bool):
    h, E, K, f = sh.h, sh.experts, sh.top_k, sh.f
    sf = sh.shared * sh.shared_f
    gemms, comms = [], []
    if layout == "ep":
        real, pad = _ep_rows(sh, T, n, padded)
        tok, rows, width = T / n, pad, f
        gemms.append(Gemm("router", 2 * tok * h * E, False, tok, h, E, 0.0, ("full", "selective")))
        # routed experts' gate / up outputs are kept under 'selective' (model/transformer.py REMAT_POLICIES)
        gemms += _swiglu_gemms("expert_", real, E // n, h, f, True, (pad - real) / real, ("full",))
        if sf:
            gemms += _swiglu_gemms("shared_", tok, 1, h, sf, False, 0.0)
        if n > 1:
            if padded:
                wire = expert_parallel_wire_bytes(num_tokens=int(tok), top_k=K, num_experts=E, axis_size=n,
                                                  hidden=h, dispatch=dispatch, itemsize=BF16)
                total = sum(wire.values())
            elif dispatch == "all_to_all":
                total = 2 * K / n * T * h * (n - 1) / n * BF16
            else:
                total = 2 * (n - 1) * tok * h * BF16
            comms.append(Comm("ep_dispatch", total / 2, "a2a" if dispatch == "all_to_all" else "ag",
                              ("full", "selective"), 2))      # counts + payload
            comms.append(Comm("ep_combine", total / 2, "a2a" if dispatch == "all_to_all" else "rs", ("full",), 2))
        units = 2 + 2 * (pad / tok) + 3 * (pad / tok) * f / h
        perm_rows = tok * K
    elif layout == "tp":
        tok, rows, width = T, T * K, f // n
        gemms.append(Gemm("router", 2 * T / n * h * E, False, T / n, h, E, 0.0, ("full", "selective")))
        gemms += _swiglu_gemms("expert_", T * K, E, h, f // n, True, 0.0, ("full",))
        if sf:
            gemms += _swiglu_gemms("shared_", T, 1, h, sf // n, False, 0.0)
        if n > 1:
            comms += [Comm("tp_ag", T * h * (n - 1) / n * BF16, "ag", ("full", "selective")),
                      Comm("tp_rs", T * h * (n - 1) / n * BF16, "rs")]
        # norms, gathered input, permuted rows, expert outputs (the combine's routing-weight gradient reads them,
        # as EP's 2 x padded rows per token count), gate/up/act
        units = 2 + n + 2 * n * K + 3 * K * f / h
        perm_rows = T * K
    else:   # xla: every device runs all T*K rows through its local experts; intermediates all-reduced
        tok, rows, width = T, T * K, f
        gemms.append(Gemm("router", 2 * T * h * E, False, T, h, E, 0.0, ("full", "selective")))
        gemms += _swiglu_gemms("expert_", T * K, max(E // n, 1), h, f, True, 0.0, ("full",))
        if sf:
            gemms += _swiglu_gemms("shared_", T, 1, h, sf, False, 0.0)
        if n > 1:   # on the GPU the partitioner all-gathers the sharded expert weights (bf16) in the forward
            # and again in the backward (plans_2xh200.json xla profile: all-gather, no large all-reduce; the
            # CPU analyzer instead all-reduces the fp32 intermediates)
            comms.append(Comm("xla_weight_ag", 3 * h * f * E * (n - 1) / n * BF16, "ag", ()))
        units = (2 + 2 * K + 3 * K * f / h) * n
        perm_rows = T * K
    # norm + residual 5h / 6h per token; permute gather 2h / scatter-add (1 + 1/K)h per row; combine
    # (1 + 1/K)h / (2 + 1/K)h per row; SwiGLU 3 / 5 per element of the (padded) buffer; router softmax 3E / 3E.
    fwd = tok * (5 * h + 3 * E) + perm_rows * (2 * h + (1 + 1 / K) * h) + rows * width * 3
    bwd = tok * (6 * h + 3 * E) + perm_rows * ((1 + 1 / K) * h + (2 + 1 / K) * h) + rows * width * 5
    if sf:
        sw = sf // (n if layout == "tp" else 1)
        fwd, bwd = fwd + tok * sw * 3, bwd + tok * sw * 5
    return gemms, (fwd, bwd), comms, units


def dense_ffn_work(sh: Shape, layout: str, T: int, n: int):
    tp = layout == "tp"
    tok = T / n if layout in ("ep", "tp") else T
    width = sh.dense_ffn // n if tp else sh.dense_ffn
    rows = T if tp else tok
    gemms = _swiglu_gemms("dense_", rows, 1, sh.h, width, False, 0.0)
    comms = ([Comm("tp_ag", T * sh.h * (n - 1) / n * BF16, "ag", ("full", "selective")),
              Comm("tp_rs", T * sh.h * (n - 1) / n * BF16, "rs")] if tp and n > 1 else [])
    ew = (tok * 5 * sh.h + rows * width * 3, tok * 6 * sh.h + rows * width * 5)
    units = 2 + (n if tp else 0) + 3 * sh.dense_ffn / sh.h
    return gemms, ew, comms, units


def layer_work(sh: Shape, recipe: str, T: int, n: int, *, dense: bool = False, dispatch: str = "all_to_all",
               padded: bool = True, sar_formula: bool = False) -> LayerWork:
    """One layer (MoE, or a leading dense one) for a microbatch of T tokens on one of n devices.

    sar_formula: activation units from the paper's formulas (SP+EP only): none (2n + 2k + 3kf + 12 + 5/m),
    selective (2kf + 4 + 2/m) elements x T*h/n; otherwise counts of the tensors this code saves.
    """
    att, ffn = RECIPES[recipe]
    g1, core, (af, ab), c1, u1 = attention_work(sh, att, T, n)
    if dense:
        g2, (ff, fb), c2, u2 = dense_ffn_work(sh, "tp" if ffn == "tp" else ("rep" if ffn == "xla" else "ep"), T, n)
    else:
        g2, (ff, fb), c2, u2 = moe_ffn_work(sh, ffn, T, n, dispatch, padded)
    real, pad = _ep_rows(sh, T, n, padded)
    # 'selective' keeps (model/transformer.py REMAT_POLICIES): the block input, q/k/v, the attention core's output,
    # the residual after attention, and of a MoE layer the routed experts' gate / up outputs [rows, width] and
    # their outputs [rows, h] (measured for a Mixtral layer at n = 8: 20.5 units, activation_memory_mixtral_n8.json)
    if dense:
        experts = 0.0
    else:
        rows, width = {"ep": (pad, sh.f), "tp": (T * sh.top_k, sh.f / n)}.get(ffn, (T * sh.top_k, sh.f))
        experts = rows * (2 * width + sh.h) / (T * sh.h / n)
    units = {"none": u1 + u2, "full": n if att == "rep" else 1,
             "selective": 2 + (sh.q_dim + 2 * sh.kv_dim) / sh.h + sh.q_dim / sh.h + experts,
             "selective_core": u1 + u2}                          # Megatron: only the attention core recomputed
    if sar_formula and recipe == "megascale" and not dense:
        # Paper §4.1 (routed experts only); a shared expert, replicated and run on the device's T/n tokens,
        # adds its SwiGLU input pair (kept under SAR) and its activation (recomputed): 2 and 3 x sf/h units.
        kf, sf = sh.top_k * sh.f / sh.h, sh.shared * sh.shared_f / sh.h
        units["none"] = 2 * n + 2 * sh.top_k + 3 * kf + 12 + 5 / sh.gqa + 3 * sf
        units["selective"] = 2 * kf + 4 + 2 / sh.gqa + 2 * sf
    return LayerWork(tuple(g1 + g2), core, (af + ff) * BF16, (ab + fb) * BF16, tuple(c1 + c2), units)


def params_per_device(sh: Shape, recipe: str, n: int) -> dict:
    """Parameters one device holds per MoE layer / dense layer / embedding+head, and which are replicated
    over the intra group (their gradients are all-reduced over it once per step)."""
    att, ffn = RECIPES[recipe]
    h = sh.h
    attn = 2 * h * sh.q_dim + 2 * h * sh.kv_dim
    expert = 3 * h * sh.f * sh.experts
    shared = 3 * h * sh.shared * sh.shared_f
    dense = 3 * h * sh.dense_ffn
    norms, router = 2 * h, h * sh.experts
    a_loc = attn / n if att == "tp" else attn
    s_loc, d_loc = (shared / n, dense / n) if ffn == "tp" else (shared, dense)
    e_loc = expert / n
    embed = sh.vocab * h * (1 if sh.tied else 2) + h
    rep_moe = (0 if att == "tp" else attn) + (0 if ffn == "tp" else shared) + norms + router
    rep_dense = (0 if att == "tp" else attn) + (0 if ffn == "tp" else dense) + norms
    return {"moe_layer": a_loc + e_loc + s_loc + norms + router, "dense_layer": a_loc + d_loc + norms,
            "embed_head": embed, "replicated_moe_layer": rep_moe if n > 1 else 0,
            "replicated_dense_layer": rep_dense if n > 1 else 0, "replicated_embed_head": embed if n > 1 else 0}
