"""Machines and models to plan for without having them: `hcache plan --device h100-sxm
--model llama-2-7b`. Devices are given by their datasheet peaks; `EFFICIENCY` turns a peak
into what a restore's large projections and cache copies reach."""

from __future__ import annotations

from dataclasses import dataclass

from hcache.model.geometry import ARCH_LLAMA, ARCH_OPT, ModelConfig


@dataclass(frozen=True)
class Device:
    label: str
    tflops: float  # dense bf16 tensor-core peak
    mem_gbps: float  # device memory bandwidth


DEVICES: dict[str, Device] = {
    "a100-40g": Device("NVIDIA A100 40GB", 312, 1555),
    "a100-80g": Device("NVIDIA A100 80GB SXM", 312, 2039),
    "h100-pcie": Device("NVIDIA H100 PCIe", 756, 2000),
    "h100-sxm": Device("NVIDIA H100 SXM", 989, 3350),
    "h200": Device("NVIDIA H200", 989, 4800),
    "b200": Device("NVIDIA B200", 2250, 8000),
    "l4": Device("NVIDIA L4", 121, 300),
    "l40s": Device("NVIDIA L40S", 362, 864),
    "a10": Device("NVIDIA A10", 125, 600),
    "rtx-4090": Device("NVIDIA RTX 4090", 165, 1008),
    "mi300x": Device("AMD Instinct MI300X", 1307, 5300),
}

# The fraction of a peak that a restore reaches: 0.75 is what large GEMMs reach on these
# parts, and with it the planner gives the HCache paper's schedules (Table 3) on its machines
EFFICIENCY = 0.75


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> ModelConfig:
    return ModelConfig(ARCH_LLAMA, 32000, hidden, ffn, layers, heads, kv_heads, hidden // heads, 4096)


# geometries only (no weights): the models the papers plan for, and a few common ones
MODELS: dict[str, ModelConfig] = {
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008),
    "llama-2-13b": _llama(40, 5120, 40, 40, 13824),
    "llama-2-70b": _llama(80, 8192, 64, 8, 28672),
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336),
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336),
    "opt-13b": ModelConfig(ARCH_OPT, 50272, 5120, 20480, 40, 40, 40, 128, 2048),
    "opt-30b": ModelConfig(ARCH_OPT, 50272, 7168, 28672, 48, 56, 56, 128, 2048),
    "opt-66b": ModelConfig(ARCH_OPT, 50272, 9216, 36864, 64, 72, 72, 128, 2048),
}
