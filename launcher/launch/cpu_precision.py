"""A 16-bit precision on a CPU plan: measured against fp32 in the parent, and a warning when it is slower.

A CPU without bf16/fp16 instructions (AVX2 only: no AVX512-BF16, no AMX) emulates them: BERT trained about 7x
slower in bf16 than in fp32 on this project's CI machine. The parent times one matmul both ways (about 50 ms)
and says once what it measured, and the fix. Exercised by: tests/test_failures_on_record.py.
"""
from __future__ import annotations

import time

import torch

SLOWER = 1.5  # a 16-bit matmul this many times slower than fp32 is worth the warning


def matmul_s(dtype: torch.dtype, size: int = 384, repeats: int = 5) -> float:
    """The best of `repeats` timings of one size x size matmul in `dtype` on this CPU."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - began)
    return best


def slow_precision_warning(name: str) -> str | None:
    """The warning for precision=`name` (bf16/fp16) on this CPU, or None when it is not slower than fp32."""
    fp32, half = matmul_s(torch.float32), matmul_s({"bf16": torch.bfloat16, "fp16": torch.float16}[name])
    ratio = half / fp32
    if ratio < SLOWER:
        return None
    return (f"warning: precision={name} on this CPU is emulated (no native {name} instructions): a matmul took "
            f"{ratio:.1f}x its fp32 time here, and training slows alike; use precision=fp32 (what precision=auto "
            f"picks on a CPU)")
