"""model.activation_checkpointing for HF models: keep each layer's inputs, recompute the rest in the backward.

The forward keeps each layer's input instead of all its intermediate tensors, and each layer's forward runs again
in the backward: the trade that lets a larger micro-batch or a longer sequence fit (bench/activation_memory.py).
Exercised by: tests/test_bert.py (`model.activation_checkpointing=true`).
"""
from __future__ import annotations

import torch

# torch's non-reentrant checkpoint, the one torch recommends and transformers 5 picks by default; transformers 4 picks
# the reentrant one, which gives a layer's weights no gradient when the layer's input needs none (frozen embeddings:
# the encoder would silently stop training) and runs its backward in a nested autograd call.
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
        # under torch.compile that warning is a graph break in every forward. (The checkpoints' config.json says
        # so too; generate() passes a use_cache of its own.)
        model.config.use_cache = False
    return model
