"""Wan2.2's transformer with Ulysses sequence parallelism.

`WanTransformer3DModel` is diffusers' class of the same name (same config, same parameter
names, so `from_pretrained` reads diffusers checkpoints as is, both experts of A14B and the 5B
model) with a new forward:

- Video tokens (frames x height x width after the 1x2x2 patches) and their 3D rotary rows are
  sharded as the IMAGE stream; self-attention (`attn1`) runs over the video stream alone through
  the shared Ulysses layer (`JointAttention` with one stream: trim / mask / none as every family).
- Text is not joined: it enters through cross-attention (`attn2`), whose queries are the rank's
  video shard and whose keys and values are all 512 text tokens, on every rank (`CrossAttention`:
  no all-to-all). The pipeline pads the prompt to 512 tokens with zeros and passes no mask; the
  zeros are not zero after the text embedder, so all 512 are kept, as in the reference.
- TI2V-5B (`expand_timesteps`): the timestep is per token ([B, N]) and so is the modulation, so
  the timestep is sharded with the video stream before the time embedder (diffusers' `_cp_plan`
  splits `timestep` at dim 1 for the same reason); padded tokens get finite modulation.

Every other op works token by token (the q/k/v projections, fused or not, and the q/k RMSNorm
across all heads of a token before the head split), so it runs unchanged on a rank's slice.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers import transformer_wan as reference
from diffusers.utils import apply_lora_scale

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.attention.layer import CrossAttention, JointAttention
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    gather_sequence,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.diffusion.models.family import SequenceParallelTransformer

# diffusers' own projections, fused or not (private: diffusers_compat.py).
_get_qkv_projections = diffusers_compat.reference_function("transformer_wan", "get_qkv_projections")


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference's interleaved-pair rotary (cos/sin [1, N, 1, D] with each value repeated twice)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanSPAttnProcessor:
    """A block's attention, as in diffusers' WanAttnProcessor up to the kernel (projections, RMSNorm
    across heads, 3D rotary on `attn1`), then the declared kind: `attn1` self-attention over the
    video stream through the Ulysses layer, `attn2` the rank's video shard attending to every text
    token (held whole on every rank)."""

    def __init__(self, cross: bool) -> None:
        self.attention = CrossAttention() if cross else JointAttention()

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cross = self.attention.kind == "cross"
        if attention_mask is not None or cross != (encoder_hidden_states is not None):
            raise ValueError("Wan self-attention takes no context, cross-attention the text; neither takes a mask")
        # The reference's projections, fused (`fuse_qkv_projections`) or not: token by token either way.
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _apply_rotary(query, *rotary_emb), _apply_rotary(key, *rotary_emb)
        out = self.attention(query, key, value) if cross else self.attention(query, key, value)[0]
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))


class WanTransformer3DModel(SequenceParallelTransformer, reference.WanTransformer3DModel):
    """Diffusers' Wan2.1/2.2 transformer, sequence-parallel under an SP process group (text-only
    conditioning: Wan2.2 T2V/I2V-A14B and TI2V-5B; Wan2.1's CLIP image tokens are refused)."""

    @functools.wraps(reference.WanTransformer3DModel.__init__)  # keeps the config signature
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.config.image_dim is not None or self.config.added_kv_proj_dim is not None:
            raise ValueError(
                "Wan checkpoints with CLIP image conditioning (image_dim / added_kv_proj_dim: Wan2.1 I2V) are not "
                "supported; Wan2.2 conditions image-to-video through the latent channels"
            )
        for block in self.blocks:
            block.attn1.set_processor(WanSPAttnProcessor(cross=False))
            block.attn2.set_processor(WanSPAttnProcessor(cross=True))

    @apply_lora_scale("attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.LongTensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor] | Transformer2DModelOutput:
        """Same arguments and outputs as the diffusers reference."""
        if encoder_hidden_states_image is not None:
            raise ValueError("encoder_hidden_states_image (Wan2.1 CLIP image tokens) is not supported")
        output = self.run_sharded(
            hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states
        )
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def forward_sharded(
        self, *, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """The per-step work under SP, tensors in and out (the runner's CUDA-graph wrapper replays it).

        The rotary tables are slices of the model's fixed buffers, made inside: no cache a graph
        could outlive.
        """
        batch, _, num_frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        freqs_cos, freqs_sin = self.rope(hidden_states)
        video = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()

        with sequence_parallel_context():
            video = shard_with_auto_pad(video, 1, IMAGE)
            rotary = (shard_with_auto_pad(freqs_cos, 1, IMAGE), shard_with_auto_pad(freqs_sin, 1, IMAGE))
            per_token = timestep.ndim == 2  # TI2V-5B: one timestep per video token
            if per_token:
                timestep = shard_with_auto_pad(timestep, 1, IMAGE)
            temb, timestep_proj, text, _ = self.condition_embedder(
                timestep.flatten() if per_token else timestep,
                encoder_hidden_states,
                None,
                timestep_seq_len=timestep.shape[1] if per_token else None,
            )
            timestep_proj = timestep_proj.unflatten(2 if per_token else 1, (6, -1))
            for block in self.blocks:
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    video = self._gradient_checkpointing_func(block, video, text, timestep_proj, rotary)
                else:
                    video = block(video, text, timestep_proj, rotary)

            if per_token:
                shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
                shift, scale = shift.squeeze(2), scale.squeeze(2)
            else:
                shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
            video = (self.norm_out(video.float()) * (1 + scale) + shift).type_as(video)
            video = gather_sequence(self.proj_out(video), 1, IMAGE)

        video = video.reshape(batch, num_frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        return video.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
