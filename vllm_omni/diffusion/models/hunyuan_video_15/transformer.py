"""HunyuanVideo 1.5's transformer with Ulysses sequence parallelism.

`HunyuanVideo15Transformer3DModel` is diffusers' class of the same name (same config, same
parameter names, so `from_pretrained` reads diffusers checkpoints as is) with a new forward:

- Video tokens (frames x height x width after patchify) and their 3D rotary rows are
  sharded as the IMAGE stream, text tokens as the TEXT stream, joined behind the video
  (`JointAttention(text_position="rear")`) like the reference's [video, text] sequence; each
  block's attention processor runs our `JointAttention` layer, and the output is gathered.
- Text padding: the reference concatenates 1000 Qwen2.5-VL prompt tokens, 256 ByT5 glyph
  tokens and 729 image tokens (all masked for text-to-video) and masks the padding in
  attention. Here the valid tokens are compacted (models/text_compaction.py) in the
  reference's order [image, glyph, prompt], the length bucketed, and the bucket's filler
  dropped by the SP padding policy, so attention stays dense.

Every other op in a block works token by token, so it runs unchanged on a rank's slice.
The diffusers pipelines (text-to-video and image-to-video) call it exactly like the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers import transformer_hunyuan_video15 as reference
from diffusers.utils import apply_lora_scale

from vllm_omni.diffusion.attention.layer import JointAttention
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    gather_sequence,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.diffusion.models.family import SequenceParallelTransformer, declare_cache_block
from vllm_omni.diffusion.models.text_compaction import (
    BUCKET_MULTIPLE,
    TextCompaction,
    cached_on_tensors,
    compact_tokens,
)

# cond_type_embed rows, as in the reference
_PROMPT_TYPE, _GLYPH_TYPE, _IMAGE_TYPE = 0, 1, 2

# Where diffusers' cache hooks (the step cache, diffusion/worker/step_cache.py) find the block's outputs:
# (hidden_states, encoder_hidden_states). diffusers 0.42.1 registers none for this block.
declare_cache_block(reference.HunyuanVideo15TransformerBlock, hidden_states_index=0, encoder_hidden_states_index=1)


class HunyuanVideo15SPAttnProcessor:
    """Projections, QK-norm and video rotary as in diffusers' HunyuanVideo15AttnProcessor2_0,
    then the shared (Ulysses) attention layer over [video, text]."""

    def __init__(self) -> None:
        self.attention = JointAttention(text_position="rear")

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if attention_mask is not None:
            raise ValueError("text padding is resolved in HunyuanVideo15Transformer3DModel.forward (text compaction)")
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)))
        key = attn.norm_k(attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        text_qkv = None
        if encoder_hidden_states is not None:
            text_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            text_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            text_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            if attn.norm_added_q is not None:
                text_query = attn.norm_added_q(text_query)
            if attn.norm_added_k is not None:
                text_key = attn.norm_added_k(text_key)
            text_qkv = (text_query, text_key, text_value)

        video_out, text_out = self.attention(query, key, value, text_qkv=text_qkv)
        video_out = video_out.flatten(2, 3).to(query.dtype)
        if text_out is None:
            return video_out, None
        video_out = attn.to_out[1](attn.to_out[0](video_out))
        return video_out, attn.to_add_out(text_out.flatten(2, 3).to(query.dtype))


@dataclass(frozen=True)
class HunyuanTextPlan:
    """Which text tokens one row (or every row) of a request keeps, in the reference's order."""

    prompt: TextCompaction  # Qwen2.5-VL tokens, before the token refiner
    with_image: bool  # image-to-video: the image tokens are valid (text-to-video masks them all)
    with_glyph: bool  # the prompt has quoted text, so ByT5 glyph tokens are valid
    joint: TextCompaction | None  # over [image, glyph, refined prompt bucket]; None: the prompt alone

    @property
    def valid_len(self) -> int:
        return (self.joint or self.prompt).valid_len


def plan_text(
    prompt_mask: torch.Tensor, glyph_mask: torch.Tensor | None, with_image: bool, image_len: int, multiple: int
) -> HunyuanTextPlan:
    """The plan for one row's masks ([L] each); syncs with the device (callers cache it)."""
    prompt = compact_tokens(prompt_mask, multiple)
    with_glyph = glyph_mask is not None and bool(glyph_mask.any())
    joint = None
    if with_image or with_glyph:
        parts = [torch.ones(image_len, dtype=torch.bool, device=prompt_mask.device)] if with_image else []
        if with_glyph:
            parts.append(glyph_mask.bool())
        parts.append(prompt.valid_mask)
        joint = compact_tokens(torch.cat(parts), multiple)
    return HunyuanTextPlan(prompt, with_image, with_glyph, joint)


def _row(x: torch.Tensor | None, i: int, batch: int) -> torch.Tensor | None:
    """Row i of a per-row tensor; tensors shared by the batch (a scalar, a batch of one) as they are."""
    if x is None or x.dim() == 0 or x.shape[0] != batch:
        return x
    return x[i : i + 1]


class HunyuanVideo15Transformer3DModel(SequenceParallelTransformer, reference.HunyuanVideo15Transformer3DModel):
    """Diffusers' HunyuanVideo 1.5 transformer, sequence-parallel under an SP process group."""

    # Text-length bucket (text_compaction.py); 1 disables bucketing.
    text_bucket_multiple: int = BUCKET_MULTIPLE

    @functools.wraps(reference.HunyuanVideo15Transformer3DModel.__init__)  # keeps the config signature
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for block in self.transformer_blocks:
            block.attn.set_processor(HunyuanVideo15SPAttnProcessor())

    def text_plans(
        self,
        encoder_attention_mask: torch.Tensor,
        encoder_attention_mask_2: torch.Tensor | None,
        image_embeds: torch.Tensor | None,
    ) -> list[HunyuanTextPlan]:
        """One plan shared by every row, or one per row when their masks differ.

        Cached on the mask and image tensors, which a pipeline passes unchanged at every step:
        only a request's first forward syncs with the device.
        """
        multiple = self.text_bucket_multiple

        def plans() -> list[HunyuanTextPlan]:
            # The reference's test: text-to-video passes all-zero image embeddings and masks their tokens.
            with_image = image_embeds is not None and not bool((image_embeds == 0).all())
            image_len = 0 if image_embeds is None else image_embeds.shape[1]
            prompt_mask = encoder_attention_mask.bool()
            glyph_mask = None if encoder_attention_mask_2 is None else encoder_attention_mask_2.bool()
            shared = bool((prompt_mask == prompt_mask[:1]).all()) and (
                glyph_mask is None or bool((glyph_mask == glyph_mask[:1]).all())
            )
            rows = range(1 if shared else prompt_mask.shape[0])
            glyph_rows = [None if glyph_mask is None else glyph_mask[i] for i in rows]
            return [plan_text(prompt_mask[i], glyph_rows[i], with_image, image_len, multiple) for i in rows]

        tensors = (encoder_attention_mask, encoder_attention_mask_2, image_embeds)
        return cached_on_tensors(tensors, ("hunyuan_video_15", multiple), plans)

    @apply_lora_scale("attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.LongTensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        timestep_r: torch.LongTensor | None = None,
        encoder_hidden_states_2: torch.Tensor | None = None,
        encoder_attention_mask_2: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
    ) -> tuple[torch.Tensor] | Transformer2DModelOutput:
        """Same arguments and outputs as the diffusers reference.

        Unlike the reference, text-to-video also accepts one row of image embeddings for a
        batch of several videos (what the pipeline passes with num_videos_per_prompt > 1).
        """
        plans = self.text_plans(encoder_attention_mask, encoder_attention_mask_2, image_embeds)
        inputs = dict(
            hidden_states=hidden_states,
            timestep=timestep,
            timestep_r=timestep_r,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_2=encoder_hidden_states_2,
            image_embeds=image_embeds,
        )
        # Rows with different text padding share the forward: each row's text is compacted by its own plan.
        output = self.run_sharded(**inputs, plan=plans[0] if len(plans) == 1 else tuple(plans))
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def _embed_text(
        self,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states_2: torch.Tensor | None,
        image_embeds: torch.Tensor | None,
        plan: HunyuanTextPlan,
    ) -> torch.Tensor:
        """The text stream [B, bucket, D]: the valid [image, glyph, prompt] tokens, then filler."""
        batch = encoder_hidden_states.shape[0]
        prompt_plan = plan.prompt
        prompt = prompt_plan.gather(encoder_hidden_states, 1)
        refiner_mask = prompt_plan.valid_mask.expand(batch, -1) if prompt_plan.has_filler else None
        prompt = self.context_embedder(prompt, timestep, refiner_mask)
        if prompt_plan.has_filler:
            # The refiner leaves fully masked rows to the kernel; zeros keep the filler finite everywhere.
            prompt = torch.where(prompt_plan.valid_mask[:, None], prompt, 0)
        prompt = prompt + self.cond_type_embed(torch.full_like(prompt[:, :, 0], _PROMPT_TYPE, dtype=torch.long))
        if plan.joint is None:
            return prompt

        parts = []
        if plan.with_image:
            image = self.image_embedder(image_embeds)
            image = image + self.cond_type_embed(torch.full_like(image[:, :, 0], _IMAGE_TYPE, dtype=torch.long))
            parts.append(image.expand(batch, -1, -1))
        if plan.with_glyph:
            glyph = self.context_embedder_2(encoder_hidden_states_2)
            parts.append(glyph + self.cond_type_embed(torch.full_like(glyph[:, :, 0], _GLYPH_TYPE, dtype=torch.long)))
        parts.append(prompt)
        return plan.joint.gather(torch.cat(parts, dim=1), 1)

    def forward_sharded(
        self,
        *,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        timestep_r: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_2: torch.Tensor | None,
        image_embeds: torch.Tensor | None,
        plan: HunyuanTextPlan | tuple[HunyuanTextPlan, ...],
    ) -> torch.Tensor:
        """The per-step work under SP. The runner's CUDA-graph wrapper runs it eagerly (the plan is an
        object, not a tensor): at video lengths a forward is GPU-bound, and its blocks are compiled.
        `plan`: one for every row, or one per row (rows with different text padding)."""
        batch, _, num_frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size_t, self.config.patch_size, self.config.patch_size
        rotary = self.rope(hidden_states)
        temb = self.time_embed(timestep, timestep_r=timestep_r)
        video = self.x_embedder(hidden_states)
        if isinstance(plan, HunyuanTextPlan):
            text = self._embed_text(encoder_hidden_states, timestep, encoder_hidden_states_2, image_embeds, plan)
            valid_len = plan.valid_len
        else:
            # Each row's text as it runs alone (the embedders are small), then zeros up to the longest row's
            # bucket: the padding policy keeps each row's attention to its own valid tokens.
            row_texts = [
                self._embed_text(
                    *(_row(x, i, batch) for x in (encoder_hidden_states, timestep, encoder_hidden_states_2)),
                    _row(image_embeds, i, batch),
                    row_plan,
                )
                for i, row_plan in enumerate(plan)
            ]
            length = max(t.shape[1] for t in row_texts)
            text = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, length - t.shape[1])) for t in row_texts])
            valid_len = tuple(row_plan.valid_len for row_plan in plan)

        with sequence_parallel_context():
            video = shard_with_auto_pad(video, 1, IMAGE)
            rotary = tuple(shard_with_auto_pad(freqs, 0, IMAGE) for freqs in rotary)
            text = shard_with_auto_pad(text, 1, TEXT, valid_len=valid_len)
            for block in self.transformer_blocks:
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    video, text = self._gradient_checkpointing_func(block, video, text, temb, None, rotary)
                else:
                    video, text = block(video, text, temb, None, rotary)
            video = self.proj_out(self.norm_out(video, temb))
            video = gather_sequence(video, 1, IMAGE)

        video = video.reshape(batch, num_frames // p_t, height // p_h, width // p_w, -1, p_t, p_h, p_w)
        return video.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)
