"""Hand-made `xmem.estimate_record.Estimate` records, for the tests of what follows an estimate (analysis, policy, filter):
the fields those stages read, the rest plain."""

from xmem.estimate_record import Estimate, GpuEstimate
from xmem.simulate import OomInfo

GIB = 1 << 30


def gpu_estimate(peak: int, total: int = 80 * GIB, fits: bool = True, name: str = "") -> GpuEstimate:
    """One GPU type's estimate; `fits=False`: the replay stopped at an out-of-memory after reaching `peak`."""
    oom = None if fits else OomInfo(index=1, requested=2 * GIB, allocated=peak, reserved=peak, capacity=total,
                                    message="CUDA out of memory")
    return GpuEstimate(gpu=name, total_bytes=total, peak_bytes=peak, peak_reserved_bytes=peak,
                       peak_allocated_bytes=peak, overhead_bytes=0, capacity_bytes=total, fits=fits, oom=oom,
                       fragmentation=0.0, traced_capability=(8, 0))


def estimate(gpus: dict[str, GpuEstimate], *, used_cuda: bool = True, suspect_reasons: tuple[str, ...] = (),
             command: tuple[str, ...] = ("python", "train.py")) -> Estimate:
    """A command's estimate on the GPU types `gpus` (catalog names)."""
    return Estimate(command=command, gpus=gpus, breakdown={}, breakdown_gpu=next(iter(gpus), ""), iterations=3,
                    seconds=0.0, warnings=(), libraries=(), used_cuda=used_cuda, torch_version="test",
                    suspect_reasons=suspect_reasons)


def estimate_of_peaks(peaks: dict[str, int]) -> Estimate:
    """An estimate that ran to the end on every GPU type, with these peaks (catalog name -> bytes)."""
    return estimate({name: gpu_estimate(peak, name=name) for name, peak in peaks.items()})
