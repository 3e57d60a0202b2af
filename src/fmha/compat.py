"""Drop-in functions with the peers' own signatures and conventions, running on fmha.

- ``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_qkvpacked_func``: FlashAttention 2's
  ``[B, S, H, D]`` API. ``causal`` and ``window_size`` are aligned to the bottom-right corner, as
  FlashAttention aligns them; ALiBi slopes give ``-slope * |i + sk - sq - j|``.
- ``scaled_dot_product_attention``: torch's ``[B, H, S, D]`` API (``attn_mask`` boolean or
  additive, ``is_causal`` from the top-left, ``enable_gqa``). What fmha cannot run (other ranks,
  head dims over 256, unsupported dtypes, ``attn_mask`` with ``is_causal``) goes to torch's own
  function, with one warning per reason.
"""

from __future__ import annotations

import warnings

import torch

from ._backend import INTERPRET
from .api import attention, attention_varlen
from .masks import Mask, MaskType, boolean_mask_bias


def _fa_mask(causal: bool, window_size) -> Mask | None:
    """FlashAttention's (causal, window_size) as a bottom-right mask; (-1, -1) is no window."""
    left, right = (int(x) for x in window_size)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    return Mask(MaskType.BOTTOM_RIGHT, left, right)


def _check_fa(softcap: float) -> None:
    if softcap != 0.0:
        raise ValueError(f"softcap: expected 0.0 (fmha has no logit soft-capping), got {softcap}")


def _fa_result(res, return_attn_probs: bool):
    if not return_attn_probs:
        return res
    # FlashAttention returns (out, softmax_lse, S_dmask); fmha does not materialize S_dmask.
    return res.out, res.lse, None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention 2's ``flash_attn_func``: ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hk, D]``."""
    _check_fa(softcap)
    res = attention(q, k, v, scale=softmax_scale, mask=_fa_mask(causal, window_size), alibi_slopes=alibi_slopes,
                    dropout_p=dropout_p, deterministic=deterministic, return_lse=return_attn_probs)
    return _fa_result(res, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention 2's ``flash_attn_qkvpacked_func``: ``qkv [B, S, 3, H, D]`` (views, no copies)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv: expected a tensor of shape [B, S, 3, H, D], got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention 2's ``flash_attn_varlen_func`` over packed ``[total, H, D]`` tensors."""
    _check_fa(softcap)
    if block_table is not None:
        raise ValueError("block_table: expected None (fmha has no paged KV cache), got a tensor")
    res = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
                           max_seqlen_k=int(max_seqlen_k), scale=softmax_scale, mask=_fa_mask(causal, window_size),
                           alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                           return_lse=return_attn_probs)
    return _fa_result(res, return_attn_probs)


_warned: set[str] = set()


def _fallback(reason: str, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fmha.compat.scaled_dot_product_attention: {reason}; using torch's implementation",
                      stacklevel=3)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                            dropout_p=dropout_p, is_causal=is_causal,
                                                            scale=scale, enable_gqa=enable_gqa)


def _unsupported(query, key, value, attn_mask, is_causal, enable_gqa) -> str | None:
    """Why fmha cannot run this call (None when it can)."""
    if not INTERPRET and query.device.type != "cuda":
        return f"tensors on {query.device.type} run on fmha only in Triton's interpreter"
    if any(t.dim() != 4 for t in (query, key, value)):
        return "only [B, H, S, D] tensors run on fmha"
    dtypes = {t.dtype for t in (query, key, value)}
    if len(dtypes) != 1 or query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "only fp16, bf16 or fp32 (one dtype for q, k, v) run on fmha"
    if max(query.shape[-1], value.shape[-1]) > 256:
        return "head dims over 256 do not run on fmha"
    if attn_mask is not None and is_causal:
        return "attn_mask together with is_causal is torch's error to raise"
    if query.shape[1] != key.shape[1] and not (enable_gqa and query.shape[1] % key.shape[1] == 0):
        return "a head-count mismatch without enable_gqa is torch's error to raise"
    return None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch's ``scaled_dot_product_attention`` on ``[B, H, S, D]`` tensors.

    A boolean ``attn_mask`` marks the pairs that take part (True) and becomes a 0/-inf additive
    bias of its own (broadcast) shape; a float mask is added to the scores. ``is_causal`` is
    top-left. Dropout draws its seed from torch's generator (fmha's bytes, not torch's).
    """
    reason = _unsupported(query, key, value, attn_mask, is_causal, enable_gqa)
    if reason is not None:
        return _fallback(reason, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = boolean_mask_bias(attn_mask)
        else:
            bias = attn_mask if attn_mask.dtype in (query.dtype, torch.float32) else attn_mask.float()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = attention(q, k, v, scale=scale, mask="t" if is_causal else None, bias=bias, dropout_p=dropout_p)
    return out.transpose(1, 2)
