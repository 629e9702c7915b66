"""Energy of each engine step, and each request's share of it (its ledger row's `energy_j`).

Measured where the machine lets us, else modelled, and the source is named with each figure:
- `rapl`: the CPU packages' own energy counters (`/sys/class/powercap/intel-rapl:N/energy_uj`; AMD Zen
  exposes them through the same driver). They count the whole package, other processes included.
- `cpu-model`: the engine process's CPU seconds in the step (every thread of it: `time.process_time`)
  times the rated power of one busy core, the package's TDP over its cores. Default 4.4 W: AMD EPYC 7763,
  280 W over 64 cores (codecarbon's CPU table); `SOBRIO_CPU_WATTS_PER_CORE` sets another. Memory, disks
  and idle power are left out, so it is a floor.
(A GPU's NVML counter is not read yet.)

A step's energy goes to its requests by their share of its FLOPs: a token costs 2 x the weights it
multiplies, plus 4 x layers x attention width x its context for attention, so a decode token at position
2,000 weighs more than a prompt token at position 10.
"""

import glob
import os
import time

DEFAULT_WATTS_PER_CORE = 4.4


class EnergyMeter:
    """A counter of joules that only grows; `source` names how it counts."""

    source = "none"

    def read(self) -> float:
        raise NotImplementedError


class RaplMeter(EnergyMeter):
    source = "rapl"

    def __init__(self, folders: list[str]):
        self.files = [os.path.join(f, "energy_uj") for f in folders]
        self.ranges = [int(open(os.path.join(f, "max_energy_range_uj")).read()) for f in folders]
        self.last = [self._raw(i) for i in range(len(self.files))]
        self.total = 0.0

    def _raw(self, i: int) -> int:
        with open(self.files[i]) as f:
            return int(f.read())

    def read(self) -> float:
        for i in range(len(self.files)):
            now = self._raw(i)
            self.total += ((now - self.last[i]) % self.ranges[i]) / 1e6  # the counter wraps at its range
            self.last[i] = now
        return self.total


class CpuModelMeter(EnergyMeter):
    source = "cpu-model"

    def __init__(self, watts_per_core: float):
        self.watts_per_core = watts_per_core

    def read(self) -> float:
        return time.process_time() * self.watts_per_core


def open_meter() -> EnergyMeter:
    """RAPL where its package counters are readable, else the CPU model."""
    folders = sorted(glob.glob("/sys/class/powercap/intel-rapl:[0-9]"))
    try:
        if folders:
            return RaplMeter(folders)
    except (OSError, ValueError):  # present but unreadable (not root): fall back
        pass
    return CpuModelMeter(float(os.environ.get("SOBRIO_CPU_WATTS_PER_CORE", DEFAULT_WATTS_PER_CORE)))


class StepFlops:
    """FLOPs of a request's tokens in a step, from the model's shape (hf config)."""

    def __init__(self, hf_config):
        d = hf_config.hidden_size
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or d // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        layers = hf_config.num_hidden_layers
        per_layer = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 3 * d * hf_config.intermediate_size
        self.per_token = 2.0 * (layers * per_layer + hf_config.vocab_size * d)
        self.per_context = 4.0 * layers * heads * head_dim

    def __call__(self, num_tokens: int, first_position: int) -> float:
        """`num_tokens` tokens from `first_position`: weights, and attention over each one's context."""
        mean_context = first_position + (num_tokens + 1) / 2
        return num_tokens * (self.per_token + self.per_context * mean_context)


def split_by_flops(joules: float, flops: list[float]) -> list[float]:
    total = sum(flops)
    return [joules * f / total for f in flops] if total > 0 else [0.0] * len(flops)
