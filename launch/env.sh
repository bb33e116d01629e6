# Environment for megascale-jax runs. Source it (`source launch/env.sh`); every variable has its reason.
# Values already set by the caller win where marked ${VAR:-default}.

# ---- XLA compiler flags (GPU; XLA parses them on CPU too and aborts on an unknown flag) ----
_megascale_xla_flags=(
  --xla_gpu_enable_latency_hiding_scheduler=true      # off by default; schedules async collectives next to independent compute (overlap)
  --xla_gpu_enable_highest_priority_async_stream=true # collectives on a high-priority stream so big GEMMs do not delay them
  --xla_gpu_enable_pipelined_all_gather=true          # start the next loop iteration's all-gather (ZeRO-1 params, pipeline ticks) early
  --xla_gpu_enable_pipelined_reduce_scatter=true      # finish a loop iteration's reduce-scatter during the next one
  --xla_gpu_enable_pipelined_all_reduce=true          # same for all-reduces inside loops
  --xla_gpu_enable_while_loop_double_buffering=true   # unroll scan loops by 2 so tick t+1 communication overlaps tick t compute
  --xla_gpu_all_gather_combine_threshold_bytes=134217728      # merge small per-parameter all-gathers into <=128 MiB ones: fewer NCCL launches
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728  # same for gradient reduce-scatters
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728      # same for all-reduces (norms, losses, plain DP)
)
if [[ "${MEGASCALE_NVSHMEM:-0}" == "1" ]]; then
  # one process per GPU + Pallas Mosaic GPU kernels with remote_ref need NVSHMEM (ANCHORS.md); opt-in
  _megascale_xla_flags+=(--xla_gpu_experimental_enable_nvshmem=true)
fi
export XLA_FLAGS="${XLA_FLAGS:-} ${_megascale_xla_flags[*]}"   # keep the caller's flags (tests add a device count)
unset _megascale_xla_flags

# ---- NCCL / NVSHMEM ----
export NCCL_NVLS_ENABLE=0        # never NVLink SHARP / multicast: it can take shared GPUs out of service
export NVSHMEM_DISABLE_NVLS=1    # the same rule for NVSHMEM's collectives
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"  # report init / transport problems without per-op logs

# ---- JAX client ----
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"  # default 0.75 leaves a quarter of HBM unused
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-${HOME:-/tmp}/.cache/megascale_jax_xla}"  # reuse compiled steps across restarts
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"  # hide XLA's INFO lines; warnings and errors stay
