"""``patchmergerv2``: the projector from merged vision features into the LM hidden size.

Shape legend: N merged tokens; M ``mm_hidden_size * kh * kw`` (4096 in the release); E
``text_hidden_size`` (7168).

y = RMSNorm_post(W2 · GELU(W1 · x)): ``mm_projector.proj.0`` W1 [M, M], exact-erf GELU (the ViT
blocks use the tanh approximation: the reference uses both on purpose), ``mm_projector.proj.2`` W2
[E, M], ``mm_projector.post_norm`` [E] with eps ``projector_ln_eps``. No pre-norm, no biases.
Source: architecture.md §11; release notes §1.8.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.layers.norm import RMSNorm
from openk3.vision.config import VisionConfig


class PatchMergerV2(nn.Module):
    """Checkpoint prefix ``mm_projector.``: ``proj`` = Sequential(Linear, GELU, Linear), ``post_norm``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        m = config.merged_hidden_size
        e = config.text_hidden_size
        self.proj = nn.Sequential(
            nn.Linear(m, m, bias=False), nn.GELU(), nn.Linear(m, e, bias=False)
        )
        self.post_norm = RMSNorm(e, eps=config.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, M] -> [N, E] (param dtype; the norm computes in fp32).

        Raises:
            ValueError: the last dim is not M.
        """
        m = self.proj[0].in_features
        if x.shape[-1] != m:
            raise ValueError(f"mm_projector input: expected last dim {m}, got {list(x.shape)}")
        return self.post_norm(self.proj(x.to(self.proj[0].weight.dtype)))
