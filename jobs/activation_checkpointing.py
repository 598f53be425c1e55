"""model.activation_checkpointing for HF models: keep each layer's inputs, recompute the rest in the backward.

The forward keeps each layer's input instead of all its intermediate tensors, and each layer's forward runs again
in the backward: the trade that lets a larger micro-batch or a longer sequence fit (bench/activation_memory.py).
Exercised by: tests/test_bert.py (`model.activation_checkpointing=true`).
"""
from __future__ import annotations

import torch

# torch's non-reentrant checkpoint, as transformers 5 chooses by default and transformers 4 does not (it picks the
# reentrant one): dynamo traces it (the reentrant one is a graph break per layer), DDP sees each parameter's gradient
# once (the reentrant one marks them ready twice under find_unused_parameters), and the parameters get gradients
# even when a layer's inputs need none.
CHECKPOINT_KWARGS = {"use_reentrant": False}


def checkpoint_activations(model: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """`model` with its layers checkpointed (in train mode; eval keeps no activations anyway) when `enabled`."""
    if not enabled:
        return model
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.activation_checkpointing=true: {type(model).__name__} does not support it; "
                         f"set model.activation_checkpointing=false")
    # transformers 5 renamed gradient_checkpointing_enable (now a deprecated alias); both take the kwargs first
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(CHECKPOINT_KWARGS)
    if getattr(model.config, "use_cache", False):
        # an encoder keeps no cache anyway, and transformers 5 warns in the forward that checkpointing turns it off:
        # under torch.compile that warning is a graph break in every forward
        model.config.use_cache = False
    return model


def checkpointed_layers(model: torch.nn.Module) -> int:
    """How many of the model's modules recompute their activations in the backward."""
    return sum(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules())
