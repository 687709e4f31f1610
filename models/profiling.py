"""Where a pass spends its time: the top operations of a profiled run, for the benches' ``--profile``.

A bench line says how long a step or a pass takes; this says which kernels take it (on a GPU the
device kernels, copies and memsets, CUDA-graph replays included; on a CPU the operators' own
time), so one bench command on a lent machine answers "where does the time go" without a trace
viewer.
"""

from __future__ import annotations

from typing import Callable

import torch


def top_ops(fn: Callable[[], object], n: int = 15, calls: int = 1) -> dict:
    """Run ``fn`` ``calls`` times under ``torch.profiler``; the ``n`` ops of most self time, per call.

    On CUDA only device events count (kernels, memcpy, memset): an aten op's row repeats the time of
    the kernels it launched, so summing both would count it twice. On the CPU, operators' self time.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        self_us = lambda e: e.self_device_time_total  # noqa: E731
    else:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]
        self_us = lambda e: e.self_cpu_time_total  # noqa: E731
    total = sum(self_us(e) for e in events)
    ranked = sorted(events, key=self_us, reverse=True)[:n]
    return {"clock": "device" if cuda else "cpu", "calls": calls, "total_ms_per_call": round(total / calls / 1e3, 4),
            "ops": [{"name": e.key[:120], "ms_per_call": round(self_us(e) / calls / 1e3, 4),
                     "share": round(self_us(e) / total, 4) if total else 0.0, "count_per_call": e.count / calls}
                    for e in ranked]}
