"""The simulated accelerator (`--device sim:NAME`): a GPU table, the roofline time
of a batch, a stream and its clocks, and the model's deterministic tokens. Torch-free;
the engine's `SimRunner` (worker/engine/sim_runner.py) puts them together."""

from worker.sim.configs import PUBLIC_CONFIGS, write_config
from worker.sim.gpus import GPUS, GpuSpec, gpu
from worker.sim.roofline import DEFAULT_LAUNCH_S, DEFAULT_MBU, DEFAULT_MFU, Roofline, StepCost
from worker.sim.shape import ModelShape, SimConfigError
from worker.sim.stream import CLOCKS, DeviceStream, StreamEvent, VirtualClock, WallClock, make_clock
from worker.sim.tokens import TokenDigest, next_token

SIM_PREFIX = "sim:"

__all__ = [
    "CLOCKS",
    "DEFAULT_LAUNCH_S",
    "DEFAULT_MBU",
    "DEFAULT_MFU",
    "GPUS",
    "PUBLIC_CONFIGS",
    "SIM_PREFIX",
    "DeviceStream",
    "GpuSpec",
    "ModelShape",
    "Roofline",
    "SimConfigError",
    "StepCost",
    "StreamEvent",
    "TokenDigest",
    "VirtualClock",
    "WallClock",
    "gpu",
    "is_sim",
    "make_clock",
    "next_token",
    "write_config",
]


def is_sim(device: str) -> bool:
    return device.startswith(SIM_PREFIX)
