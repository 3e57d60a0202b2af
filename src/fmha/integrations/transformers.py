"""fmha as a Hugging Face transformers attention implementation.

    import fmha.integrations.transformers as fmha_hf
    fmha_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fmha")

``register()`` adds ``attention_forward`` to transformers' ``AttentionInterface`` and SDPA's mask
builder to its ``AttentionMaskInterface`` under the same name, so models hand fmha the masks they
hand SDPA: none for plain causal attention, else a boolean ``[B, 1, Sq, Sk]`` mask (padding,
sliding windows). GQA runs natively (no repeated K/V). transformers is imported only here.
"""

from __future__ import annotations

import torch

from ..api import attention
from ..masks import boolean_mask_bias

NAME = "fmha"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' attention signature: ``[B, H, S, D]`` in, ``([B, S, H, D], None)`` out."""
    if kwargs.get("softcap") is not None:
        raise ValueError("softcap: expected None (fmha has no logit soft-capping), got "
                         f"{kwargs['softcap']}")
    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and kv_length > q_length:
        # transformers' SDPA convention for a causal call without a mask: keys beyond the queries drop.
        key, value = key[:, :, :q_length], value[:, :, :q_length]
        if position_bias is not None:
            position_bias = position_bias[..., :q_length]
    bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            bias = boolean_mask_bias(attention_mask)
        else:
            bias = attention_mask.float()
    if position_bias is not None:
        bias = position_bias.float() if bias is None else bias + position_bias.float()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = attention(q, k, v, scale=scaling, mask="t" if is_causal else None, bias=bias, dropout_p=dropout)
    return out, None


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` select fmha in transformers models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
