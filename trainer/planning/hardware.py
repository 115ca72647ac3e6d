"""Bundled GPU profiles: the published HBM bandwidth and dense bf16 tensor-core peak of each card.

Why: a user planning for hardware they have not measured needs a starting point; the roofline
(`roofline.py`) prices a decode round from these two numbers and efficiency factors. Figures are
NVIDIA's datasheets (dense = half of the "with sparsity" figure the datasheets headline); a GB200
entry is one Blackwell GPU of a GB200 NVL72 (the rack's figures divided by 72). Published peaks
are not achieved: the roofline applies `memory_efficiency` and `compute_efficiency` (defaults in
`roofline.RooflineConfig`), and a cost table measured on the user's own node
(`specrl bench gpu`) replaces the roofline altogether.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True, frozen=True)
class HardwareProfile:
    """One GPU's published figures."""

    name: str
    hbm_tb_s: float
    """HBM bandwidth, TB/s (10^12 bytes per second)."""
    bf16_dense_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    memory_gb: float
    source: str

    def __post_init__(self) -> None:
        for name in ("hbm_tb_s", "bf16_dense_tflops", "memory_gb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.name}: {name} must be > 0, got {getattr(self, name)}")

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_tb_s * 1e12

    @property
    def flops_per_s(self) -> float:
        return self.bf16_dense_tflops * 1e12


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(
            name="h100",
            hbm_tb_s=3.35,
            bf16_dense_tflops=989.4,
            memory_gb=80,
            source="NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 1,979 TFLOPS bf16 with sparsity",
        ),
        HardwareProfile(
            name="h200",
            hbm_tb_s=4.8,
            bf16_dense_tflops=989.4,
            memory_gb=141,
            source="NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 1,979 TFLOPS bf16 with sparsity",
        ),
        HardwareProfile(
            name="b200",
            hbm_tb_s=8.0,
            bf16_dense_tflops=2250.0,
            memory_gb=180,
            source="NVIDIA HGX B200 datasheet, per GPU: 8 TB/s HBM3e, 4.5 PFLOPS bf16 with sparsity",
        ),
        HardwareProfile(
            name="gb200",
            hbm_tb_s=8.0,
            bf16_dense_tflops=2500.0,
            memory_gb=186,
            source="NVIDIA GB200 NVL72 datasheet / 72 GPUs: 576 TB/s HBM3e, 360 PFLOPS bf16 with sparsity, 13.4 TB",
        ),
        HardwareProfile(
            name="a100",
            hbm_tb_s=2.039,
            bf16_dense_tflops=312.0,
            memory_gb=80,
            source="NVIDIA A100 SXM4 80GB datasheet: 2,039 GB/s HBM2e, 312 TFLOPS bf16 dense",
        ),
        HardwareProfile(
            name="l40s",
            hbm_tb_s=0.864,
            bf16_dense_tflops=362.05,
            memory_gb=48,
            source="NVIDIA L40S datasheet: 864 GB/s GDDR6, 733 TFLOPS bf16 with sparsity",
        ),
        HardwareProfile(
            name="h20",
            hbm_tb_s=4.0,
            bf16_dense_tflops=148.0,
            memory_gb=96,
            source="NVIDIA H20 specifications: 4.0 TB/s HBM3, 148 TFLOPS bf16 dense",
        ),
    )
}

ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "gb200-nvl72": "gb200", "a100-80gb": "a100"}


def profile(name: str) -> HardwareProfile:
    """The bundled profile `name` (case-insensitive); an unknown name lists the known ones."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in PROFILES:
        raise ValueError(
            f"unknown hardware profile {name!r}; known profiles: {', '.join(PROFILES)} "
            "(or measure your own node: specrl bench gpu, then --costs FILE)"
        )
    return PROFILES[key]
