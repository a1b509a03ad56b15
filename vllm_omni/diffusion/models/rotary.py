"""Rotary position embeddings given as complex frequencies (the families whose references multiply complex numbers),
applied in real arithmetic.

The references multiply complex numbers (`view_as_complex(x.float()) * freqs`). Inductor generates no code for
complex operators, so inside a compiled block that product ran as an eager kernel of its own, with a conversion
kernel on each side: 11 of the 139 ms of a 20B image model's forward at 1024x1024 on an H100
(docs/performance.md). The same products in real arithmetic fuse with the QK-norm before
them and the cast after. Each element is still one fp32 product pair and one sum or difference, as the complex
multiply computes it: the same bits on the CPU (tests/diffusion/models/test_rotary.py) and, compiled, on an H100.
"""

from __future__ import annotations

import torch


def rotate_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`x` [..., D] with its channel pairs (2i, 2i + 1) rotated by the complex `freqs` (broadcast against x's
    [..., D/2] pairs), in fp32; returned in x's dtype. The tables stay complex, as diffusers' blocks pass them (a
    processor set in ours' place gets what it expects); their real view costs nothing."""
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = torch.view_as_real(freqs).unbind(-1)
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).type_as(x)
