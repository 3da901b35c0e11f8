"""The roofline time of one forward pass of a batch on a simulated GPU.

For a step computing, per sequence, `num_new` tokens after `num_computed`
cached ones (a prefill chunk or one decode token), `sampled` of them sampled:

    FLOPs = 2 x layer params x layers x tokens        (every linear layer, every token)
          + 2 x head params x sampled rows             (the LM head, only where a token is drawn)
          + 4 x heads x head_dim x layers x sum(context of each new token)   (QK^T and AV)
    bytes = weights                                    (read once per step)
          + K/V bytes per token x (context read + new tokens written)
    time  = max(FLOPs / (peak x MFU), bytes / (HBM x MBU)) + launch

The context of a new token at position p is p + 1 (causal). Activations,
norms and the sampler are left out. A copy (copy-on-write) or a tier move
is its bytes over HBM or the host link. docs/simulator.md states the
defaults and checks them against published figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from worker.sim.gpus import GpuSpec
from worker.sim.shape import ModelShape

__all__ = ["DEFAULT_LAUNCH_S", "DEFAULT_MBU", "DEFAULT_MFU", "Roofline", "StepCost"]

DEFAULT_MFU = 0.5
DEFAULT_MBU = 0.8
DEFAULT_LAUNCH_S = 0.0005


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    seconds: float  # max(compute_s, memory_s) + launch

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True, slots=True)
class Roofline:
    gpu: GpuSpec
    model: ModelShape
    mfu: float = DEFAULT_MFU
    mbu: float = DEFAULT_MBU
    launch_s: float = DEFAULT_LAUNCH_S

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1 or not 0 < self.mbu <= 1:
            raise ValueError(f"MFU and MBU must be in (0, 1], got {self.mfu:g} and {self.mbu:g}")
        if self.launch_s < 0:
            raise ValueError(f"the launch cost must be >= 0, got {self.launch_s:g} s")

    def step(self, seqs: Iterable[tuple[int, int, int]]) -> StepCost:
        """The cost of one step over `(num_computed, num_new, sampled)` per sequence."""
        m = self.model
        tokens = sampled = context = kv_read = 0
        for computed, new, drawn in seqs:
            tokens += new
            sampled += drawn
            # positions computed .. computed + new - 1 attend to computed + 1 .. computed + new keys
            context += new * computed + new * (new + 1) // 2
            kv_read += computed + new
        flops = (
            2.0 * m.layer_params * m.num_layers * tokens
            + 2.0 * m.head_params * sampled
            + 4.0 * m.num_heads * m.head_dim * m.num_layers * context
        )
        nbytes = float(m.weight_bytes) + m.kv_bytes_per_token * (kv_read + tokens)
        compute_s = flops / (self.gpu.peak_flops * self.mfu)
        memory_s = nbytes / (self.gpu.hbm_bytes_per_s * self.mbu)
        return StepCost(
            flops, nbytes, compute_s, memory_s, max(compute_s, memory_s) + self.launch_s
        )

    def copy_seconds(self, nbytes: float) -> float:
        """A device-to-device copy (read and write) of `nbytes`."""
        return 2 * nbytes / (self.gpu.hbm_bytes_per_s * self.mbu)

    def host_seconds(self, nbytes: float) -> float:
        """A move of `nbytes` between the device and host memory."""
        return nbytes / self.gpu.host_bytes_per_s
