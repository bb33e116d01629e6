"""Hardware table: GPUs (peak rates, memory, links) and clusters (GPUs per node x nodes x network).

Every number carries its source in `GPU.sources`. Peak tensor rates are the dense (non-sparse) figures:
NVIDIA's datasheets print the 2:4-sparsity figure with an asterisk; dense is half of it. NVLink is quoted by
NVIDIA as the bidirectional total per GPU; one direction is half. `nvlink_achieved_gbps` is what collectives
reach per GPU per direction in practice (a measurement, sourced per GPU), `net_gbit` the NIC rate per GPU of
the typical node (one 400 Gb/s ConnectX-7 per GPU on HGX/DGX Hopper, 200 Gb/s HDR on DGX A100).
"""
from __future__ import annotations

import dataclasses

_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5), https://www.nvidia.com/en-us/data-center/h100/"
_NV_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM), https://www.nvidia.com/en-us/data-center/h200/"
_NV_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), https://www.nvidia.com/en-us/data-center/a100/"
_DEEPEP = ("DeepEP README (deepseek-ai/DeepEP, H800 + CX7 400 Gb/s): '~160 GB/s NVLink maximum', '~50 GB/s' "
           "RDMA maximum; measured intranode EP8 dispatch/combine 153/158 GB/s, internode 43-47 GB/s")
_H800 = ("H800 SXM5 = H100 SXM5 silicon with NVLink cut to 400 GB/s bidirectional and FP64 cut (NVIDIA export "
         "variant, 2023; e.g. aiwiki.ai/wiki/nvidia_h800); tensor rates, HBM as H100 SXM5; the MegaScale-MoE paper's "
         "Table 4 gives the same: 989 TFLOPS, 80 GB, 3.4 TB/s, NVLink 400 GB/s")
_H20 = ("NVIDIA HGX H20 (export variant, 2024) as published by OEM/spec aggregators (e.g. "
        "willitrunai.com/gpus/h20-96gb): 148 TFLOPS FP16/BF16 dense, 296 FP8, 96 GB HBM3 4.0 TB/s, NVLink 900 GB/s")
_DGX_H100 = ("NVIDIA DGX H100/H200 user guide: 8x ConnectX-7 400 Gb/s InfiniBand/Ethernet, one per GPU; the "
             "MegaScale-MoE paper (Appendix A.1) calls 'the inter-device NIC communication bandwidth 50 GB/s' the "
             "typical H100 SXM machine (its own cluster's network is not stated)")
_DGX_A100 = "NVIDIA DGX A100 user guide: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU"
_OURS_LINK = ("benchmarks/results/plans_2xh200.json profiles (2 x H200, NV18): comm ms fitted to calls x latency "
              "+ wire bytes / bandwidth over the manual plans -- efficiency.link_fit()")


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_tflops: float      # dense tensor-core BF16
    peak_fp8_tflops: float       # dense tensor-core FP8 (0 = none)
    hbm_gb: float
    hbm_tbps: float
    nvlink_gbps: float           # nominal, one direction, per GPU
    nvlink_achieved_gbps: float | None   # measured per direction per GPU; None = scale H200's measured fraction
    net_gbit: float              # typical NIC rate per GPU
    sources: dict

    def link_gbps(self) -> float:
        """Achieved NVLink bandwidth per GPU per direction (GB/s)."""
        if self.nvlink_achieved_gbps is not None:
            return self.nvlink_achieved_gbps
        from megascale_jax.planner import efficiency
        return self.nvlink_gbps * efficiency.nvlink_achieved_h200() / GPUS["h200"].nvlink_gbps


def _gpu(name, bf16, fp8, hbm, bw, nvl, achieved, net, src_compute, src_link, src_net):
    return GPU(name, bf16, fp8, hbm, bw, nvl, achieved, net,
               {"peak_bf16_tflops": src_compute, "peak_fp8_tflops": src_compute, "hbm_gb": src_compute,
                "hbm_tbps": src_compute, "nvlink_gbps": src_compute + " (bidirectional total / 2)",
                "nvlink_achieved_gbps": src_link, "net_gbit": src_net})


GPUS = {
    "h100": _gpu("H100 SXM5", 989.4, 1978.9, 80, 3.35, 450, None, 400, _NV_H100,
                 "scaled from the H200 measurement (same NVLink 4, 18 links): " + _OURS_LINK, _DGX_H100),
    "h200": _gpu("H200 SXM", 989.4, 1978.9, 141, 4.8, 450, None, 400, _NV_H200, _OURS_LINK, _DGX_H100),
    "h800": _gpu("H800 SXM5", 989.4, 1978.9, 80, 3.35, 200, 155.0, 400, _H800,
                 _DEEPEP + " (mean of 153 and 158)", _DEEPEP + " (one CX7 400 Gb/s per GPU)"),
    "a100": _gpu("A100 SXM4 80GB", 312.0, 0.0, 80, 2.039, 300, None, 200, _NV_A100,
                 "scaled from the H200 measurement by nominal NVLink (NVLink 3, 600 GB/s)", _DGX_A100),
    "h20": _gpu("H20", 148.0, 296.0, 96, 4.0, 450, None, 400, _H20,
                "scaled from the H200 measurement (NVLink 4, 900 GB/s)", _DGX_H100 + " (assumed same NIC)"),
}

# Effective fraction of the NIC line rate that collectives reach: DeepEP's internode 43-47 GB/s on a 50 GB/s
# (400 Gb/s) CX7 -> 0.9. Latencies per collective call are stated assumptions (NCCL small-message latency
# order of magnitude); they matter only for messages well under a megabyte.
NET_EFFICIENCY = 0.9
NET_EFFICIENCY_SOURCE = _DEEPEP + ": 45/50 GB/s"
LATENCY_INTER_S = 25e-6
LATENCY_SOURCE = ("NVLink: fitted on the 2 x H200 profiles (efficiency.link_fit); network: assumption 25 us per "
                  "call (NCCL order of magnitude, not measured here)")
# Memory the planner lets a plan use: the allocator, workspaces and fragmentation take the rest.
USABLE_HBM_FRACTION = 0.9
USABLE_HBM_SOURCE = "assumption: 90% of HBM usable (XLA's default preallocation is 75%; set higher for big runs)"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`nodes` nodes of `gpus_per_node` GPUs; NVLink inside a node, `net_gbit` per GPU between nodes."""
    gpu: GPU
    gpus_per_node: int
    nodes: int
    net_gbit: float
    usable_fraction: float = USABLE_HBM_FRACTION

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def intra_bw(self) -> float:
        """Bytes/s one GPU sends over NVLink (achieved, one direction)."""
        return self.gpu.link_gbps() * 1e9

    def inter_bw(self) -> float:
        """Bytes/s one GPU sends over the network (achieved)."""
        return self.net_gbit / 8 * NET_EFFICIENCY * 1e9

    def hbm_bw(self) -> float:
        return self.gpu.hbm_tbps * 1e12

    def usable_hbm(self) -> float:
        return self.gpu.hbm_gb * 1e9 * self.usable_fraction

    def group_in_node(self, size: int, stride: int) -> bool:
        """Whether a group of `size` devices spaced `stride` apart (row-major mesh) stays inside one node."""
        return size * stride <= self.gpus_per_node or size == 1

    def bandwidth(self, size: int, stride: int) -> tuple[float, float]:
        """(bytes/s, latency s) for a collective over `size` devices spaced `stride` apart."""
        if self.group_in_node(size, stride):
            from megascale_jax.planner import efficiency
            return self.intra_bw(), efficiency.link_fit()[0]
        return self.inter_bw(), LATENCY_INTER_S


def make_cluster(gpu: str, num_gpus: int, gpus_per_node: int = 8, net_gbit: float | None = None) -> Cluster:
    """A cluster of `num_gpus` GPUs of kind `gpu` (a key of GPUS); fewer than a node is one partial node."""
    spec = GPUS[gpu.lower()]
    if num_gpus < gpus_per_node:
        return Cluster(spec, num_gpus, 1, spec.net_gbit if net_gbit is None else net_gbit)
    if num_gpus % gpus_per_node:
        raise ValueError(f"{num_gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes")
    return Cluster(spec, gpus_per_node, num_gpus // gpus_per_node, spec.net_gbit if net_gbit is None else net_gbit)


def hardware_sources() -> list[tuple[str, str, str]]:
    """(parameter, value, source) rows for --explain."""
    rows = []
    for key, g in GPUS.items():
        for field, src in g.sources.items():
            value = getattr(g, field)
            rows.append((f"{key}.{field}", "measured fraction of H200" if value is None else f"{value:g}", src))
    rows += [("network efficiency", f"{NET_EFFICIENCY:g}", NET_EFFICIENCY_SOURCE),
             ("latency per call, network", f"{LATENCY_INTER_S * 1e6:g} us", LATENCY_SOURCE),
             ("usable HBM", f"{USABLE_HBM_FRACTION:g}", USABLE_HBM_SOURCE)]
    return rows
