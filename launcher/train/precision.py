"""fp32, bf16 and fp16 as one code path: autocast around the forward, a GradScaler that is a no-op
unless fp16. Exercised by: `python -m launcher +exp=toy precision=fp16`.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str
    device_type: str
    tf32: bool = True  # train.tf32: fp32 matmuls on a GPU's tensor cores (CUDA only)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES[self.name]

    def autocast(self) -> AbstractContextManager:
        """Forward only: backward runs outside autocast, in the dtype each op chose."""
        dtype = self.autocast_dtype
        return torch.autocast(self.device_type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def apply_tf32(self) -> None:
        """CUDA: TF32 for fp32 matmuls and convolutions on Ampere+ (~free speed), or neither. Set both ways: torch's
        own default leaves cuDNN's on, so train.tf32=false must turn it off for exact fp32 convolutions.
        The legacy flags, not the per-backend fp32_precision of torch 2.9+: a write through that makes inductor's
        reads of the legacy ones raise "mix of the legacy and new APIs" (pytorch#189955)."""
        if self.device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.tf32

    def grad_scaler(self, init_scale: float, growth_interval: int) -> torch.amp.GradScaler:
        # fp16 has too few exponent bits for small gradients; bf16 and fp32 need no scaling.
        return torch.amp.GradScaler(self.device_type, init_scale=init_scale,
                                    growth_interval=growth_interval, enabled=self.name == "fp16")
