"""The GPUs a `sim:NAME` device can be: public datasheet figures, one row each.

`peak_flops` is the dense (no sparsity) BF16/FP16 tensor-core peak,
`hbm_bytes_per_s` the memory bandwidth, `memory_bytes` the memory (the
datasheet's GB read as GiB, as `nvidia-smi` reports these parts), and
`host_bytes_per_s` the host link per direction (half the datasheet's
bidirectional PCIe figure). Sources: docs/simulator.md, "The GPU table".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPUS", "GpuSpec", "gpu"]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    description: str
    peak_flops: float  # dense BF16/FP16, FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int
    host_bytes_per_s: float  # PCIe, one direction
    datasheet: str


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            "h100",
            "NVIDIA H100 SXM5 80GB",
            989.4e12,
            3.35e12,
            80 * GIB,
            64e9,
            "https://www.nvidia.com/en-us/data-center/h100/",
        ),
        GpuSpec(
            "h200",
            "NVIDIA H200 SXM 141GB",
            989.4e12,
            4.8e12,
            141 * GIB,
            64e9,
            "https://www.nvidia.com/en-us/data-center/h200/",
        ),
        GpuSpec(
            "a100-40gb",
            "NVIDIA A100 SXM4 40GB",
            312e12,
            1.555e12,
            40 * GIB,
            32e9,
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        ),
        GpuSpec(
            "a100-80gb",
            "NVIDIA A100 SXM4 80GB",
            312e12,
            2.039e12,
            80 * GIB,
            32e9,
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        ),
        GpuSpec(
            "l4",
            "NVIDIA L4 24GB",
            121e12,
            300e9,
            24 * GIB,
            32e9,
            "https://www.nvidia.com/en-us/data-center/l4/",
        ),
    )
}


def gpu(name: str) -> GpuSpec:
    """The GPU called `name` (`sim:NAME` without the prefix); ValueError naming the known ones."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown simulated GPU {name!r}; known: {', '.join(GPUS)}") from None
