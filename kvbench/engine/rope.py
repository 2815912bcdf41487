"""RoPE arithmetic on cached keys: methods that place keys at other positions (LM-Infinite's distance ceiling,
InfLLM's fixed-distance memory) and the engine's compact positions share it. Imports no session."""

from __future__ import annotations

import torch


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE keys ``(B, H, T, D)`` by ``delta`` positions ``(B, H, T)`` (RoPE rotations compose
    additively; rotate-half layout, as every transformers RoPE model)."""
    angles = delta.unsqueeze(-1) * inv_freq  # (B, H, T, D/2)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(keys.dtype), emb.sin().to(keys.dtype)
    half = keys.shape[-1] // 2
    rotated_half = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos + rotated_half * sin
