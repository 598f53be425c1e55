"""What an HF encoder's attention gets as its mask: none for an unpadded batch, a prepared one for a padded batch.

Two GPU costs of HF's mask handling, and what the jobs do instead (same logits; tests/test_attention.py):
- Eager, HF's SDPA attention checks `mask.all()` on the GPU in every forward to learn whether it may drop
  the mask: a host sync (train.sync_check found it). An unpadded batch (known on the CPU at collate time)
  goes without its mask; a padded batch's goes in a form HF takes as it is (`mask_form`).
- Traced, transformers 5 does not look at a mask's values, and some versions then build an all-True
  (batch, 1, seq, seq) mask for a batch given NO mask: 5.17 (the H100 machine's) under torch.compile, 5.23
  under torch.export. SDPA then runs its masked kernel where eager runs FlashAttention. SDPA_UNMASKED is
  SDPA whose mask builder returns no mask when given none and no pattern, which needs no look at a tensor.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

# Encoders tested to give the 2D mask's logits with the rewritten mask (tests/test_attention.py); others keep it
MASK_REWRITTEN = ("bert", "roberta", "albert", "electra", "distilbert")
SDPA_UNMASKED = "sdpa_unmasked"  # an attention implementation name, registered with transformers by use_sdpa_unmasked


def model_inputs(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's inputs from a collated batch: an unpadded batch's without its attention mask, a padded
    batch's mask in the form `mask_form` names, else the 2D mask."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "id", "padded", "attention_mask")}
    mask = batch.get("attention_mask")
    if mask is not None and batch.get("padded", True):
        hf = hf_model(model)
        form = mask_form(hf)
        if form == "additive":
            mask = (1.0 - mask[:, None, None, :].to(hf.dtype)) * torch.finfo(hf.dtype).min
        elif form == "3d":
            mask = mask[:, None, :]
        inputs["attention_mask"] = mask
    return inputs


def mask_form(hf: Any) -> str | None:
    """A known encoder whose module builds its masks with transformers 5's masking_utils takes an additive 4D
    mask as it is ("an already prepared 4D mask"); BERT and RoBERTa in transformers 4 with SDPA make a
    (batch, 1, seq) mask additive themselves (get_extended_attention_mask) where they would check a 2D one.
    Eager attention in 4 never checks; a decoder's causal mask (GPT-2's too) comes only with a 2D mask."""
    attention = hf.config._attn_implementation
    if hf.config.model_type not in MASK_REWRITTEN or attention not in ("sdpa", "eager", SDPA_UNMASKED) or \
            getattr(hf.config, "is_decoder", False):  # (not every config has is_decoder)
        return None
    if _masking_utils(hf):  # transformers 5
        return "additive"
    if attention == "sdpa" and hf.config.model_type in ("bert", "roberta"):
        return "3d"
    return None


def use_sdpa_unmasked(hf: Any) -> Any:
    """`hf` (a transformers model) with SDPA_UNMASKED for its attention where it is a known encoder on SDPA
    that builds its masks with masking_utils (transformers 5); any other model as it is."""
    if mask_form(hf) != "additive" or hf.config._attn_implementation != "sdpa":
        return hf
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask

    def sdpa_mask_unless_none(*args: Any, **kwargs: Any) -> Any:
        # Only where sdpa_mask itself may drop the mask (called with allow_is_bidirectional_skip), given no
        # padding mask by its name and no pattern: eager, sdpa_mask learns the same by reading the mask
        if "attention_mask" in kwargs and kwargs["attention_mask"] is None and \
                kwargs.get("allow_is_bidirectional_skip") and kwargs.get("mask_function") is bidirectional_mask_function:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(SDPA_UNMASKED, sdpa_attention_forward)
    AttentionMaskInterface.register(SDPA_UNMASKED, sdpa_mask_unless_none)
    hf.set_attn_implementation(SDPA_UNMASKED)
    return hf


def hf_model(model: torch.nn.Module) -> Any:
    """The transformers model inside DDP and torch.compile's wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def _masking_utils(hf: Any) -> bool:
    return hasattr(sys.modules[type(hf.base_model).__module__], "create_bidirectional_mask")
