"""SmLanes: one GPU's streaming multiprocessors split into two disjoint lanes (CUDA green contexts), a stream each.

Owns the green contexts and their streams; whoever holds an SmLanes issues work to `decode` or `prefill` (plain
torch streams, usable with `torch.cuda.stream(...)`, Triton launches and CUDA graph capture) and calls close() when
done. Work on one lane runs only on that lane's SMs, so a decode step on its lane is not queued behind prefill
kernels occupying the others (issue 43).

Why the driver API and not torch.cuda.green_contexts: each GreenContext.create() splits the whole device anew, so
two of them overlap (both begin at the first SMs); here one split yields the decode group and its disjoint
remainder, and both contexts are made from that one split. The two share the driver's default work queues: asking
for balanced (non-overlapping) ones per context was refused by the H200's driver 580 (CUDA_ERROR_INVALID_RESOURCE_TYPE,
docs/benchmark-log.md "One GPU, both phases"), so this module does not offer it.

Needs cuda-bindings (cuda.bindings.driver) and a GPU of compute capability 9.0+ (Hopper: partitions in steps of
8 SMs); `available()` says whether this process can make lanes, and why not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _driver():
    from cuda.bindings import driver  # optional: only the GPU path needs it
    return driver


def _check(result: tuple, what: str):
    """cuda-bindings calls return (CUresult, *values): the values, or RuntimeError naming the call and the error."""
    status, *values = result
    driver = _driver()
    if status != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(status)[1]
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values)


def available(device: torch.device) -> str | None:
    """None when SM lanes can be made on `device`, else why not."""
    if device.type != "cuda":
        return f"SM lanes need a CUDA device ({device} is not one)"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return f"SM lanes need compute capability 9.0+ ({torch.cuda.get_device_name(device)})"
    try:
        _driver()
    except ImportError:
        return "SM lanes need cuda-bindings (pip install cuda-bindings)"
    return None


@dataclass
class SmLanes:
    """Two disjoint SM partitions of one device, a non-blocking stream on each."""

    decode_sms: int
    prefill_sms: int
    decode: torch.cuda.ExternalStream
    prefill: torch.cuda.ExternalStream
    _handles: list = field(default_factory=list, repr=False)  # green contexts and raw streams, for close()

    def close(self) -> None:
        driver = _driver()
        for kind, handle in reversed(self._handles):
            if kind == "stream":
                driver.cuStreamDestroy(handle)
            else:
                driver.cuGreenCtxDestroy(handle)
        self._handles.clear()


def split_sms(device: torch.device, decode_sms: int) -> SmLanes:
    """Lanes of `decode_sms` SMs (rounded up by the driver to its partition step) and the rest of the device."""
    why = available(device)
    if why:
        raise RuntimeError(why)
    driver = _driver()
    torch.cuda.init()
    torch.zeros(1, device=device)  # the primary context exists before the green ones are made beside it
    dev = _check(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
    whole = _check(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                   "cuDeviceGetDevResource")
    groups, count, rest = _check(driver.cuDevSmResourceSplitByCount(1, whole, 0, decode_sms),
                                 f"cuDevSmResourceSplitByCount({decode_sms} SMs)")
    if count != 1:
        raise RuntimeError(f"the driver made {count} groups of >= {decode_sms} SMs, not one")
    lanes, handles = [], []
    try:
        for part in (groups[0], rest):
            desc = _check(driver.cuDevResourceGenerateDesc([part], 1), "cuDevResourceGenerateDesc")
            ctx = _check(driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                         "cuGreenCtxCreate")
            handles.append(("ctx", ctx))
            stream = _check(driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
                            "cuGreenCtxStreamCreate")
            handles.append(("stream", stream))
            lanes.append(torch.cuda.ExternalStream(int(stream), device=device))
    except Exception:
        SmLanes(0, 0, None, None, handles).close()  # type: ignore[arg-type]
        raise
    return SmLanes(int(groups[0].sm.smCount), int(rest.sm.smCount), lanes[0], lanes[1], handles)
