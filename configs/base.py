"""Base configuration: every key the trainer knows, with its default.

Model files (configs/mixtral_8x7b.py, ...) start from `get_config()` here and override. Any key not defined
here is an error (megascale_jax/config.py checks), so a typo cannot silently fall back to a default.

    python -m megascale_jax.train --config configs/base.py --config.train.steps=10
"""
from ml_collections import ConfigDict


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.name = "base"
    # How the intra-node domain is used: xla | megascale (SP+EP) | megatron_tp | tp_ep | sp_tp (configs/plans.py).
    # parallel.plan / attention / ffn / intra below override the recipe when set.
    c.plan_recipe = "xla"

    c.model = ConfigDict()
    c.model.vocab_size = 256
    c.model.num_layers = 2
    c.model.hidden = 64
    c.model.num_heads = 4
    c.model.num_kv_heads = 2          # GQA: num_heads % num_kv_heads == 0; ratio m = heads / kv heads
    c.model.head_dim = 0              # per-head width; 0 = hidden / num_heads (Qwen3-MoE sets it explicitly)
    c.model.qkv_bias = False          # biases on the q/k/v projections (Qwen2-MoE)
    c.model.qk_norm = False           # RMSNorm over head_dim on q and k before RoPE (Qwen3-MoE)
    c.model.attention_kind = "gqa"    # the attention module (model/attention.py)
    c.model.dense_ffn = 256           # FFN width of the leading dense layers (DeepSeekMoE's first layer)
    c.model.num_dense_layers = 0      # leading layers with a dense SwiGLU FFN instead of MoE
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    # Tied output head: rsqrt_hidden scales logits by 1/sqrt(hidden) (our init, std-1 table); none = as
    # Hugging Face ties (import tied HF models with this).
    c.model.tied_head_scale = "rsqrt_hidden"
    c.model.max_seq_len = 2048        # RoPE is computed on the fly; this bounds train.seq_len

    c.model.moe = ConfigDict()
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.expert_ffn = 128
    c.model.moe.num_shared_experts = 0   # shared experts run on every token (DeepSeekMoE, Hunyuan-Large)
    c.model.moe.shared_expert_ffn = 0    # width of each shared expert; 0 = expert_ffn
    c.model.moe.shared_expert_gate = False   # scale the shared experts' output by sigmoid(x . w) (Qwen2-MoE)
    c.model.moe.renormalize = True       # renormalise the top-k probabilities to sum to 1
    c.model.moe.router_kind = "softmax_topk"   # the router module (model/moe/router.py)
    c.model.moe.aux_loss_weight = 0.01
    c.model.moe.z_loss_weight = 0.001
    # Experts counted as one virtual expert in the balance loss (paper: the experts of one EP rank).
    # 0 = the experts of one expert-parallel rank (num_experts / parallel.intra); 1 = classic per-expert loss.
    c.model.moe.balance_group_size = 1
    # 0 = dropless. > 0: expert-parallel all-to-all buffers hold capacity_factor * T*K/n rows per rank and the
    # overflow is dropped; dropped tokens are counted and reported in the metrics, never silent.
    c.model.moe.capacity_factor = 0.0

    c.parallel = ConfigDict()
    c.parallel.data = -1              # data-parallel size; -1 = all devices left after intra and pipe
    c.parallel.intra = 0              # intra-node domain (SP / EP / TP group); 0 = the plan recipe's choice
    c.parallel.pipe = 1               # pipeline stages (layers split over the 'pipe' mesh axis)
    c.parallel.pipeline_schedule = "1f1b"   # gpipe | 1f1b | interleaved (pipe > 1; train.microbatches flow through)
    c.parallel.virtual_stages = 1     # layer chunks per device (interleaved schedule)
    c.parallel.plan = ""              # "" = recipe | xla: annotations + propagation | manual: per-device shard_map
    c.parallel.attention = ""         # "" = recipe | sp (Ulysses) | tp (Megatron heads) — manual plan only
    c.parallel.ffn = ""               # "" = recipe | ep (whole experts per rank) | tp (expert FFN width sharded)
    c.parallel.ep_dispatch = "auto"   # all_to_all | all_gather | auto (by top_k vs the crossover below)
    c.parallel.dispatch_crossover_top_k = 6   # auto uses all_gather when top_k > this (paper: > 6)
    c.parallel.dispatch_dtype = "bf16"  # EP token exchange on the wire: bf16 | fp8 (E4M3 + scales, fp32 sums)
    # autodiff: the MoE block is differentiated by JAX | macro: its forward and backward are written out by
    # hand so each collective runs beside independent compute (parallel/overlap.py; manual plan).
    c.parallel.moe_layer = "autodiff"
    c.parallel.overlap_chunks = 1     # macro layer: the forward token exchange in this many chunks (pipelined)
    # moe_layer='fused' with SP attention: its GEMM+A2A as ring (ppermute steps) | mosaic (one Mosaic GPU kernel
    # storing each tile into its destination; bf16 on GPU; not yet run on several GPUs, so never chosen for you)
    c.parallel.attention_exchange = "ring"
    # moe_layer=fused with ep_dispatch=all_gather: how the dispatch's rows move: ring | runs ((expert, source)-
    # ordered runs, one all-to-all) | mosaic (runs pushed under the first expert GEMM, one kernel; GPU)
    c.parallel.dispatch_exchange = "ring"
    # none: optimizer state sharded like the parameters. zero1: optimizer state sharded over `data`.
    c.parallel.optimizer_sharding = "none"
    # Data-parallel gradient exchange: fp32 (compiler all-reduce / reduce-scatter) | bf16 | fp8 on the wire,
    # summed locally in fp32 (per-device step: manual plan or pipeline).
    c.parallel.grad_comm = "fp32"

    c.kernels = ConfigDict()          # resolved once when the model is built (megascale_jax/step.py)
    c.kernels.grouped_gemm = "auto"   # xla (lax.ragged_dot) | pallas (Mosaic GPU kernel) | auto
    # kernel | mask | auto (mask for the pallas kernel under expert parallelism, where receive buffers are mostly
    # tail rows: the expert FFN fwd+bwd 1.035x (Mixtral EP8) / 1.235x (Qwen3 EP8) faster on an H200)
    c.kernels.grouped_gemm_tail = "auto"
    # auto | xla | pallas (the loss head's softmax passes as two kernels) | pallas_fused (the head GEMM and the loss as
    # one custom VJP: its forward kernel writes the logits' gradient over them) | pallas_fused_one_read (the same
    # head, its kernel reading the logits once: 1.3-1.7% more tokens/s). auto: pallas_fused_one_read on GPU per device
    c.kernels.cross_entropy = "auto"
    # auto | xla | pallas (the dispatch's and combine's row gathers, forward and backward, as Pallas kernels:
    # pallas_kernels/row_gather.py; GPU per device; no faster than XLA on an H200, so auto is xla)
    c.kernels.permute = "auto"
    # auto | xla | pallas (AdamW of the unrolled layer stacks' GEMM weights from their per-layer gradients, one
    # kernel pass that also writes the compute copies: no concatenation of the stacked gradients; GPU per device).
    # auto: pallas where it can run and train.microbatches is 1 (megascale_jax/updaters.py resolve_adamw), else xla
    c.kernels.adamw = "auto"
    # auto | separate | separate_pallas_bwd (the activation's backward in one Pallas pass) | fused (first expert
    # GEMMs + SwiGLU in one kernel; not faster yet). auto: separate_pallas_bwd on GPU per device, for the experts only
    # where their GEMM outputs are not masked (grouped_gemm_tail mask); else separate (model/moe/experts.py SwigluImpl)
    c.kernels.swiglu = "auto"
    c.kernels.attention = "auto"      # xla | cudnn | auto (cudnn on GPU with bf16)

    c.train = ConfigDict()
    c.train.steps = 100
    c.train.global_batch = 8
    c.train.microbatches = 1          # per optimizer step: gradient accumulation, or the pipeline's microbatches
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 10
    c.train.min_lr_ratio = 0.1        # cosine decays to learning_rate * min_lr_ratio
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    # Adam's moments as stored: float32 | bfloat16 (DeepSeek-V3's choice: half the moments' memory and 8 fewer
    # bytes a parameter in the update pass; the update is computed in float32; needs 1 - b1, 1 - b2 >= 2^-7)
    c.train.adam_moments_dtype = "float32"
    c.train.grad_clip = 1.0
    c.train.param_dtype = "float32"   # master weights
    c.train.compute_dtype = "bfloat16"
    c.train.remat = "none"            # none | full | selective
    # Layers per iteration of the scanned layer stacks. 1 keeps compile time flat in depth; a full unroll
    # (>= num_layers) drops the loop's stacked residual and gradient buffers (zero-filled, then slice-updated).
    c.train.scan_unroll = 1
    # A step whose loss or gradient is NaN/Inf: stop (end the run, exit non-zero, never checkpoint it) or skip
    # (leave parameters and optimizer state as they were, count it in metrics.nonfinite_steps).
    c.train.nonfinite = "stop"
    c.train.loss_spike_factor = 3.0   # a logged loss above this x the median of the last 20 counts as a spike
    c.train.seed = 0
    c.train.log_every = 10
    c.train.eval_every = 50
    c.train.eval_batches = 4

    c.data = ConfigDict()
    c.data.source = "text"            # text (built-in real-text corpus) | tokens (file) | synthetic
    c.data.path = ""                  # token file for source=tokens
    c.data.dtype = "uint16"           # token file dtype: uint16 | uint32
    c.data.eval_fraction = 0.05
    c.data.cache_dir = ""             # "" = ~/.cache/megascale_jax (or $MEGASCALE_JAX_CACHE)

    c.checkpoint = ConfigDict()
    c.checkpoint.dir = ""             # "" = no checkpoints
    c.checkpoint.every = 0
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True

    c.output = ConfigDict()
    c.output.dir = ""                 # "" = runs/<name>
    c.output.tensorboard = True

    c.profile = ConfigDict()
    c.profile.start_step = -1         # >= 0: write a jax.profiler trace of steps [start, start + num_steps)
    c.profile.num_steps = 3
    return c


def large_scale_training(c: ConfigDict, **overrides) -> ConfigDict:
    """What the paper-scale model configs share: the paper's plan (SP attention + EP experts over the node's
    devices) and the training schedule (override per model where it differs)."""
    c.plan_recipe = "megascale"
    c.train.update(global_batch=256, seq_len=4096, learning_rate=3e-4, warmup_steps=2000, steps=100_000,
                   eval_every=1000, log_every=10)
    c.train.update(**overrides)
    return c
