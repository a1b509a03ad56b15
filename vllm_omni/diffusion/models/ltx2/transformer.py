"""LTX-2's audio-video transformer with Ulysses sequence parallelism.

`LTX2VideoTransformer3DModel` is diffusers' class of the same name (same config, same parameter
names, so `from_pretrained` reads diffusers checkpoints as is) with a new forward. Its blocks carry
two token streams, video and audio, that attend to each other; under SP both are sharded:

- the video tokens, with everything that travels with them (their RoPE coordinates, a per-token
  timestep: image-to-video's), as the IMAGE stream; the audio tokens (and their coordinates, a
  per-token audio timestep) as the AUDIO stream. Each is padded to its own multiple of the degree
  (`shard_with_auto_pad`), and the padding policy is the SP context's for both;
- video self-attention (`attn1`) and audio self-attention (`audio_attn1`) run the shared Ulysses layer
  over their own stream (`JointAttention(stream=...)`: trim / mask / none as every family);
- audio-to-video (`audio_to_video_attn`: video queries, audio keys) and video-to-audio
  (`video_to_audio_attn`) cross-attention run `StreamCrossAttention`: one all-to-all brings the query
  stream's queries and the other stream's keys and values, and the layout says what the queries may
  see of the key stream's padding (trimmed, masked, or seen with a warning in `none`);
- the prompt enters by cross-attention (`attn2`, `audio_attn2`): every rank holds the whole prompt
  (`CrossAttention`, no all-to-all), with the pipeline's text mask where it masks any token.

Every other op of a block works token by token (modulation, gates, norms, feed-forwards, RoPE), so it
runs unchanged on a rank's slices. The output is gathered per stream.

The blocks are diffusers' `LTX2VideoTransformerBlock`, called with the audio stream as their second
argument under the name diffusers' cache hooks read as the block's other stream (`encoder_hidden_states`):
the step cache (First-Block-Cache) then keeps and reuses the audio residual like a joint block's text.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.transformers import transformer_ltx2 as reference
from diffusers.utils import apply_lora_scale

from vllm_omni.diffusion.attention.layer import CrossAttention, JointAttention, StreamCrossAttention
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    gather_sequence,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.diffusion.models.family import SequenceParallelTransformer, declare_cache_block
from vllm_omni.diffusion.models.text_compaction import cached_on_tensors

AUDIO = "audio"  # the audio token stream (the video tokens are the IMAGE stream)

# The attentions of a block, by attribute, and the kind each runs.
_ATTENTIONS = {
    "attn1": lambda: JointAttention(stream=IMAGE),
    "audio_attn1": lambda: JointAttention(stream=AUDIO),
    "attn2": CrossAttention,
    "audio_attn2": CrossAttention,
    "audio_to_video_attn": lambda: StreamCrossAttention(IMAGE, AUDIO),
    "video_to_audio_attn": lambda: StreamCrossAttention(AUDIO, IMAGE),
}


class LTX2SPAttnProcessor:
    """Projections, gates, QK-norm and RoPE as in diffusers' LTX2PerturbedAttnProcessor (which, without a
    perturbation, is its LTX2AudioVideoAttnProcessor), then the declared attention layer."""

    def __init__(self, attention: torch.nn.Module) -> None:
        self.attention = attention

    def __call__(
        self,
        attn: reference.LTX2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: bool | None = None,
    ) -> torch.Tensor:
        kind = self.attention.kind
        if (kind == "joint") != (encoder_hidden_states is None):
            raise ValueError(f"a {kind} attention takes {'no' if kind == 'joint' else 'a'} context")
        if attention_mask is not None and kind != "cross":
            raise ValueError("only the prompt cross-attention takes a mask (the prompt's)")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(context)
        if all_perturbed is None:  # the forward decides it on the host; a direct call may leave it to us
            all_perturbed = bool((perturbation_mask == 0).all()) if perturbation_mask is not None else False
        if all_perturbed:  # spatio-temporal guidance: the values, no attention
            hidden_states = value
        else:
            query = attn.norm_q(attn.to_q(hidden_states))
            key = attn.norm_k(attn.to_k(context))
            if query_rotary_emb is not None:
                rotate = (
                    reference.apply_interleaved_rotary_emb
                    if attn.rope_type == "interleaved"
                    else reference.apply_split_rotary_emb
                )
                query = rotate(query, query_rotary_emb)
                key = rotate(key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
            query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
            if kind == "joint":
                out = self.attention(query, key, value)[0]
            elif kind == "cross":
                mask = None if attention_mask is None else attention_mask.view(attention_mask.shape[0], 1, 1, -1)
                out = self.attention(query, key, value, mask)
            else:
                out = self.attention(query, key, value)
            hidden_states = out.flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                hidden_states = torch.lerp(value.flatten(2, 3), hidden_states, perturbation_mask)
        if gate_logits is not None:
            gates = 2.0 * torch.sigmoid(gate_logits)  # [B, T, H]
            hidden_states = (hidden_states.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](hidden_states))


class LTX2SPTransformerBlock(reference.LTX2VideoTransformerBlock):
    """diffusers' block (same parameters, same forward), its second argument, the audio stream, named
    `encoder_hidden_states`: diffusers' cache hooks pass through, keep and reuse that argument as a block's
    second stream. Called positionally, in the reference forward's argument order."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, *args: Any) -> Any:
        return super().forward(hidden_states, encoder_hidden_states, *args)


# Where diffusers' cache hooks (the step cache, diffusion/worker/step_cache.py) find the block's outputs:
# (video, audio).
declare_cache_block(LTX2SPTransformerBlock, hidden_states_index=0, encoder_hidden_states_index=1)


def _text_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The reference's additive [B, 1, L] prompt bias for a [B, L] mask; None where it masks nothing (cached on the
    mask tensor, which the pipeline passes unchanged at every step: one device sync a request)."""
    if mask is None or mask.ndim != 2:
        return mask
    if cached_on_tensors((mask,), "ltx2_text_mask", lambda: bool(mask.bool().all())):
        return None
    return ((1 - mask.to(dtype)) * -10000.0).unsqueeze(1)


class LTX2VideoTransformer3DModel(SequenceParallelTransformer, reference.LTX2VideoTransformer3DModel):
    """Diffusers' LTX-2 audio-video transformer, sequence-parallel under an SP process group."""

    _repeated_blocks = ["LTX2SPTransformerBlock"]

    @functools.wraps(reference.LTX2VideoTransformer3DModel.__init__)  # keeps the config signature
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for block in self.transformer_blocks:
            block.__class__ = LTX2SPTransformerBlock  # a subclass without state of its own: only the forward differs
            for name, attention in _ATTENTIONS.items():
                getattr(block, name).set_processor(LTX2SPAttnProcessor(attention()))

    @apply_lora_scale("attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_encoder_hidden_states: torch.Tensor,
        timestep: torch.LongTensor,
        audio_timestep: torch.LongTensor | None = None,
        sigma: torch.Tensor | None = None,
        audio_sigma: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        audio_encoder_attention_mask: torch.Tensor | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        fps: float = 24.0,
        audio_num_frames: int | None = None,
        video_coords: torch.Tensor | None = None,
        audio_coords: torch.Tensor | None = None,
        isolate_modalities: bool = False,
        spatio_temporal_guidance_blocks: list[int] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        use_cross_timestep: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        video_self_attention_mask: torch.Tensor | None = None,
        video_keyframes_mask: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor] | reference.AudioVisualModelOutput:
        """Same arguments and outputs as the diffusers reference; `video_self_attention_mask` (a dense
        video-by-video mask, the in-context LoRA pipeline's) is not supported."""
        if video_self_attention_mask is not None:
            raise NotImplementedError(
                "video_self_attention_mask (a dense [B, video, video] mask) is not supported by this transformer"
            )
        batch = hidden_states.shape[0]
        if video_coords is None:
            video_coords = self.rope.prepare_video_coords(
                batch, num_frames, height, width, hidden_states.device, fps=fps
            )
        if audio_coords is None:
            audio_coords = self.audio_rope.prepare_audio_coords(batch, audio_num_frames, audio_hidden_states.device)
        # Spatio-temporal guidance: which blocks perturb their self-attention, and whether every row is perturbed
        # (decided here, on the host, once a call; the default mask perturbs every row).
        stg_blocks = tuple(sorted(set(spatio_temporal_guidance_blocks or ())))
        if stg_blocks and perturbation_mask is None:
            perturbation_mask = torch.zeros((batch,), device=hidden_states.device)
        if perturbation_mask is not None and perturbation_mask.ndim == 1:
            perturbation_mask = perturbation_mask[:, None, None]
        all_perturbed = perturbation_mask is not None and bool((perturbation_mask == 0).all())
        marker = None
        if self.config.use_keyframes_abs_pos_embedding and video_keyframes_mask is not None:
            marker = (video_keyframes_mask > 0).to(dtype=hidden_states.dtype)
        with sequence_parallel_context() as ctx:
            if ctx.enabled:
                for name in _ATTENTIONS:
                    self.check_sequence_parallel_processors({"transformer_blocks": name}, (LTX2SPAttnProcessor,))
            output = self.run_sharded(
                hidden_states=hidden_states,
                audio_hidden_states=audio_hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                audio_encoder_hidden_states=audio_encoder_hidden_states,
                timestep=timestep,
                audio_timestep=audio_timestep if audio_timestep is not None else timestep,
                sigma=sigma,
                audio_sigma=audio_sigma if audio_sigma is not None else sigma,
                encoder_attention_mask=_text_bias(encoder_attention_mask, hidden_states.dtype),
                audio_encoder_attention_mask=_text_bias(audio_encoder_attention_mask, audio_hidden_states.dtype),
                video_coords=video_coords,
                audio_coords=audio_coords,
                keyframes=marker,
                perturbation_mask=perturbation_mask,
                stg_blocks=stg_blocks,
                all_perturbed=all_perturbed,
                isolate_modalities=isolate_modalities,
                use_cross_timestep=use_cross_timestep,
            )
        video_len = hidden_states.shape[1] * self.config.out_channels
        video = output[:, :video_len].unflatten(1, (hidden_states.shape[1], -1))
        audio = output[:, video_len:].unflatten(1, (audio_hidden_states.shape[1], -1))
        if not return_dict:
            return (video, audio)
        return reference.AudioVisualModelOutput(sample=video, audio_sample=audio)

    @staticmethod
    def _shard_timestep(timestep: torch.Tensor | None, batch: int, stream: str) -> torch.Tensor | None:
        """A timestep as the reference flattens it; one per token (image-to-video's first frame at 0) is sharded
        with its stream, so the modulation it gives is the rank's tokens' own."""
        if timestep is None or timestep.numel() == batch:
            return timestep
        return shard_with_auto_pad(timestep.reshape(batch, -1), 1, stream)

    def forward_sharded(
        self,
        *,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        audio_timestep: torch.Tensor,
        sigma: torch.Tensor | None,
        audio_sigma: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
        audio_encoder_attention_mask: torch.Tensor | None,
        video_coords: torch.Tensor,
        audio_coords: torch.Tensor,
        keyframes: torch.Tensor | None,
        perturbation_mask: torch.Tensor | None,
        stg_blocks: tuple[int, ...],
        all_perturbed: bool,
        isolate_modalities: bool,
        use_cross_timestep: bool,
    ) -> torch.Tensor:
        """The per-step work under SP, tensors in, one tensor out: the video output [B, N_video * C] then the
        audio output [B, N_audio * C_audio], flattened side by side (the CUDA-graph wrapper replays it)."""
        batch = hidden_states.shape[0]
        video_dtype, audio_dtype = hidden_states.dtype, audio_hidden_states.dtype
        config = self.config
        video = self.proj_in(hidden_states)
        if keyframes is not None:
            video = video + keyframes * self.keyframes_abs_pos_embedding.to(dtype=video.dtype)
        audio = self.audio_proj_in(audio_hidden_states)

        with sequence_parallel_context():
            video = shard_with_auto_pad(video, 1, IMAGE)
            audio = shard_with_auto_pad(audio, 1, AUDIO)
            # RoPE for the rank's tokens only: their coordinates sharded with their streams.
            video_coords = shard_with_auto_pad(video_coords, 2, IMAGE)
            audio_coords = shard_with_auto_pad(audio_coords, 2, AUDIO)
            video_rotary = self.rope(video_coords, device=video.device)
            audio_rotary = self.audio_rope(audio_coords, device=audio.device)
            video_ca_rotary = self.cross_attn_rope(video_coords[:, 0:1, :], device=video.device)
            audio_ca_rotary = self.cross_attn_audio_rope(audio_coords[:, 0:1, :], device=audio.device)
            timestep = self._shard_timestep(timestep, batch, IMAGE)
            audio_timestep = self._shard_timestep(audio_timestep, batch, AUDIO)

            # The reference's embeddings and modulation, on the rank's tokens.
            gate_factor = config.cross_attn_timestep_scale_multiplier / config.timestep_scale_multiplier
            temb, embedded_timestep = self.time_embed(timestep.flatten(), batch_size=batch, hidden_dtype=video_dtype)
            temb = temb.view(batch, -1, temb.size(-1))
            embedded_timestep = embedded_timestep.view(batch, -1, embedded_timestep.size(-1))
            temb_audio, audio_embedded_timestep = self.audio_time_embed(
                audio_timestep.flatten(), batch_size=batch, hidden_dtype=audio_dtype
            )
            temb_audio = temb_audio.view(batch, -1, temb_audio.size(-1))
            audio_embedded_timestep = audio_embedded_timestep.view(batch, -1, audio_embedded_timestep.size(-1))
            temb_prompt = temb_prompt_audio = None
            if self.prompt_modulation and config.use_prompt_adaln_single:  # LTX-2.3
                temb_prompt, _ = self.prompt_adaln(sigma.flatten(), batch_size=batch, hidden_dtype=video_dtype)
                temb_prompt_audio, _ = self.audio_prompt_adaln(
                    audio_sigma.flatten(), batch_size=batch, hidden_dtype=audio_dtype
                )
                temb_prompt = temb_prompt.view(batch, -1, temb_prompt.size(-1))
                temb_prompt_audio = temb_prompt_audio.view(batch, -1, temb_prompt_audio.size(-1))
            video_ca_timestep = audio_sigma.flatten() if use_cross_timestep else timestep.flatten()
            video_ca_scale_shift, _ = self.av_cross_attn_video_scale_shift(
                video_ca_timestep, batch_size=batch, hidden_dtype=video_dtype
            )
            video_ca_gate, _ = self.av_cross_attn_video_a2v_gate(
                video_ca_timestep * gate_factor, batch_size=batch, hidden_dtype=video_dtype
            )
            video_ca_scale_shift = video_ca_scale_shift.view(batch, -1, video_ca_scale_shift.shape[-1])
            video_ca_gate = video_ca_gate.view(batch, -1, video_ca_gate.shape[-1])
            audio_ca_timestep = sigma.flatten() if use_cross_timestep else audio_timestep.flatten()
            audio_ca_scale_shift, _ = self.av_cross_attn_audio_scale_shift(
                audio_ca_timestep, batch_size=batch, hidden_dtype=audio_dtype
            )
            audio_ca_gate, _ = self.av_cross_attn_audio_v2a_gate(
                audio_ca_timestep * gate_factor, batch_size=batch, hidden_dtype=audio_dtype
            )
            audio_ca_scale_shift = audio_ca_scale_shift.view(batch, -1, audio_ca_scale_shift.shape[-1])
            audio_ca_gate = audio_ca_gate.view(batch, -1, audio_ca_gate.shape[-1])

            text, audio_text = encoder_hidden_states, audio_encoder_hidden_states
            if config.use_prompt_embeddings:  # LTX-2.0
                text = self.caption_projection(text).view(batch, -1, video.size(-1))
                audio_text = self.audio_caption_projection(audio_text).view(batch, -1, audio.size(-1))

            for index, block in enumerate(self.transformer_blocks):
                perturbed = index in stg_blocks
                args = (
                    video,
                    audio,
                    text,
                    audio_text,
                    temb,
                    temb_audio,
                    video_ca_scale_shift,
                    audio_ca_scale_shift,
                    video_ca_gate,
                    audio_ca_gate,
                    temb_prompt,
                    temb_prompt_audio,
                    video_rotary,
                    audio_rotary,
                    video_ca_rotary,
                    audio_ca_rotary,
                    encoder_attention_mask,
                    audio_encoder_attention_mask,
                    None,  # self_attention_mask (video): refused in forward
                    None,  # audio_self_attention_mask
                    None,  # a2v_cross_attention_mask
                    None,  # v2a_cross_attention_mask
                    not isolate_modalities,  # use_a2v_cross_attention
                    not isolate_modalities,  # use_v2a_cross_attention
                    perturbation_mask if perturbed else None,
                    all_perturbed if perturbed else False,
                )
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    video, audio = self._gradient_checkpointing_func(block, *args)
                else:
                    video, audio = block(*args)

            shift, scale = (self.scale_shift_table[None, None] + embedded_timestep[:, :, None]).unbind(2)
            video = self.proj_out(self.norm_out(video) * (1 + scale) + shift)
            audio_shift, audio_scale = (
                self.audio_scale_shift_table[None, None] + audio_embedded_timestep[:, :, None]
            ).unbind(2)
            audio = self.audio_proj_out(self.audio_norm_out(audio) * (1 + audio_scale) + audio_shift)
            video = gather_sequence(video, 1, IMAGE)
            audio = gather_sequence(audio, 1, AUDIO)
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)
