"""GLM-Image's DiT with Ulysses sequence parallelism.

`GlmImageTransformer2DModel` is diffusers' class of the same name (same config, same parameter
names, so `from_pretrained` reads the diffusers checkpoint as is) with a new forward:

- Joint attention over `[glyph text, image]` (text in front) through the shared Ulysses layer
  (`JointAttention`): both streams are sharded, each padded at its own tail, so the cond pass
  (the prompt's quoted text) and the uncond pass (the glyph text of "", one token) pad
  differently and both stay exact under trim and mask. q, k and v of both streams come from the
  same projections (the reference concatenates the streams before projecting); the 2D rotary
  rows apply to the image tokens only and are sharded with them.
- The prior tokens (the AR stage's ids, one per image token) are embedded per token:
  `prior_token_id` and `prior_token_drop` are sharded with the image stream before the
  embedding, so each rank embeds its own tokens. Padded rows get id 0, not dropped: finite. Ids
  of another shape that the reference broadcasts over the image tokens (one per sample) are
  embedded whole, then broadcast to the stream and sharded with it.
- Each stream has its own AdaLN and both share the feed-forward weights; both work token by
  token, so the reference's block runs unchanged on a rank's shards.

Image-to-image: the pipeline first runs each condition image (its latents and AR tokens, no
text) through the DiT with the reference's K/V cache in "write" mode, then reads the cached keys
and values in every cond forward ("read"; the uncond forward "skip"s them). Here the condition
pass is sharded like any image stream, and each rank caches its own shard of the condition's keys
and values, padding included; a later forward joins them in front of [text, image] as streams
that give keys and values only (one per condition image), under the same padding policy
(distributed/sequence_parallel.py), so they stay exact at padded sizes.

The reference's `attention_mask` adds a 0/1 float mask to the logits (the pipeline never passes
one): refused.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers import transformer_glm_image as reference
from diffusers.utils import apply_lora_scale

from vllm_omni.diffusion.attention.layer import JointAttention
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    gather_sequence,
    record_sharded_stream,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.diffusion.models.family import SequenceParallelTransformer, declare_cache_block

MASK_REFUSED = "attention_mask is not supported (the pipeline passes none; the reference's mask path is broken)"
CONDITION = "condition"  # the SP streams of cached condition images: condition0, condition1, ...


class ConditionWriter:
    """One layer's "write" pass: collects this rank's (key, value) shards of the condition image."""

    def __init__(self) -> None:
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None


class ConditionKV:
    """One layer's cached condition keys and values for a "read" pass: (stream, key, value) per condition image."""

    def __init__(self, streams: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]) -> None:
        self.streams = streams


# Where diffusers' cache hooks (the step cache, diffusion/worker/step_cache.py) find the block's outputs:
# (hidden_states, encoder_hidden_states). diffusers 0.42.1 registers none for this block.
declare_cache_block(reference.GlmImageTransformerBlock, hidden_states_index=0, encoder_hidden_states_index=1)


class GlmImageSPAttnProcessor:
    """Projections, QK LayerNorm and the image's 2D rotary as in the reference, per stream, then
    the shared (Ulysses) attention layer over [text, image]."""

    def __init__(self) -> None:
        self.attention = JointAttention(text_position="front")

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: ConditionWriter | ConditionKV | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise ValueError(MASK_REFUSED)
        dtype = encoder_hidden_states.dtype
        img_q, img_k, img_v = _qkv(attn, hidden_states, dtype)
        txt_q, txt_k, txt_v = _qkv(attn, encoder_hidden_states, dtype)
        if image_rotary_emb is not None:
            img_q = apply_rotary_emb(img_q, image_rotary_emb, sequence_dim=1, use_real_unbind_dim=-2)
            img_k = apply_rotary_emb(img_k, image_rotary_emb, sequence_dim=1, use_real_unbind_dim=-2)
        kv_streams = ()
        if isinstance(kv_cache, ConditionWriter):  # the reference caches [text, image]: the pipeline's text is empty
            kv_cache.kv = (torch.cat([txt_k, img_k], dim=1), torch.cat([txt_v, img_v], dim=1))
        elif isinstance(kv_cache, ConditionKV):
            kv_streams = kv_cache.streams
        img_out, txt_out = self.attention(img_q, img_k, img_v, text_qkv=(txt_q, txt_k, txt_v), kv_streams=kv_streams)
        return _out(attn, img_out, img_q.dtype), _out(attn, txt_out, img_q.dtype)


def _qkv(attn, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stream's q, k, v [B, S, H, D] (the projections are shared by both streams)."""
    query = attn.to_q(x).unflatten(2, (attn.heads, -1))
    key = attn.to_k(x).unflatten(2, (attn.heads, -1))
    value = attn.to_v(x).unflatten(2, (attn.heads, -1))
    if attn.norm_q is not None:
        query = attn.norm_q(query).to(dtype=dtype)
    if attn.norm_k is not None:
        key = attn.norm_k(key).to(dtype=dtype)
    return query, key, value


def _cache_mode(kv_caches: reference.GlmImageKVCache | None) -> str | None:
    """The caches' mode: None or "skip" (no condition), "write" or "read" (the pipeline sets every layer's alike)."""
    if kv_caches is None:
        return None
    modes = {cache.mode for cache in kv_caches.caches}
    if len(modes) > 1:
        raise ValueError(f"the layers' K/V caches are in different modes: {sorted(map(str, modes))}")
    mode = modes.pop()
    return None if mode == "skip" else mode


def _out(attn, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return attn.to_out[1](attn.to_out[0](x.flatten(2, 3).to(dtype)))


def _patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/p * W/p, C * p * p], the layout of the reference's image projector."""
    batch, channels, height, width = latents.shape
    patches = latents.reshape(batch, channels, height // p, p, width // p, p)
    return patches.permute(0, 2, 4, 1, 3, 5).flatten(3, 5).flatten(1, 2)


class GlmImageTransformer2DModel(SequenceParallelTransformer, reference.GlmImageTransformer2DModel):
    """Diffusers' GLM-Image DiT, sequence-parallel under an SP process group (the condition image's K/V too)."""

    @functools.wraps(reference.GlmImageTransformer2DModel.__init__)  # keeps the config signature
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for block in self.transformer_blocks:
            block.attn1.set_processor(GlmImageSPAttnProcessor())
        # The last grid's rotary tables on the forward's device: the reference rebuilds them on the
        # host at every forward (and copies them to the device in every layer).
        self._rotary_key: tuple | None = None
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per K/V cache written by this model: each sample's condition images' true token counts.
        self._condition_lens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def rotary_tables(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's 2D rotary cos/sin [N, head_dim] for this latent grid, on its device (fp32)."""
        key = (tuple(latents.shape[-2:]), latents.device)
        if self._rotary_key != key:
            self._rotary = tuple(table.to(latents.device) for table in self.rope(latents))
            self._rotary_key = key
        return self._rotary

    @apply_lora_scale("attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        prior_token_id: torch.Tensor,
        prior_token_drop: torch.Tensor,
        timestep: torch.LongTensor,
        target_size: torch.Tensor,
        crop_coords: torch.Tensor,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        attention_mask: torch.Tensor | None = None,
        kv_caches: reference.GlmImageKVCache | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor] | Transformer2DModelOutput:
        """Same arguments and outputs as the diffusers reference (no mask). `kv_caches` in "write" mode cache
        this forward's keys and values (the condition image's), in "read" mode join them to its keys."""
        if attention_mask is not None:
            raise ValueError(MASK_REFUSED)
        # The pipeline always passes a cache; text-to-image never gives it a mode, nor does its uncond pass ("skip").
        mode = _cache_mode(kv_caches)
        condition: dict[str, Any] = {}
        if mode == "write":
            condition["condition_out"] = [ConditionWriter() for _ in self.transformer_blocks]
        elif mode == "read":
            condition = self._cached_condition(kv_caches, hidden_states.shape[0])
        # Computed here, not in the graphed forward_sharded: a CUDA graph must own what it reads
        # (as arguments, it copies them).
        rotary_cos, rotary_sin = image_rotary_emb if image_rotary_emb is not None else self.rotary_tables(hidden_states)
        output = self.run_sharded(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            prior_token_id=prior_token_id,
            prior_token_drop=prior_token_drop,
            timestep=timestep,
            target_size=target_size,
            crop_coords=crop_coords,
            rotary_cos=rotary_cos.to(hidden_states.device),
            rotary_sin=rotary_sin.to(hidden_states.device),
            attention_kwargs=attention_kwargs,
            **condition,
        )
        if mode == "write":
            self._store_condition(kv_caches, condition["condition_out"], hidden_states, encoder_hidden_states)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def _store_condition(
        self,
        kv_caches: reference.GlmImageKVCache,
        writers: list[ConditionWriter],
        latents: torch.Tensor,
        text: torch.Tensor,
    ) -> None:
        """Append this rank's condition keys and values to the caches, and the condition's true length to
        `_condition_lens` (a rank's shard does not tell it)."""
        p = self.config.patch_size
        length = text.shape[1] + (latents.shape[-2] // p) * (latents.shape[-1] // p)
        first = kv_caches.caches[0]
        if not first.k_caches:  # a cache written afresh (or cleared by the pipeline)
            self._condition_lens[kv_caches] = []
        per_sample = self._condition_lens.setdefault(kv_caches, [])
        per_sample.extend([] for _ in range(first.current_sample_idx + 1 - len(per_sample)))
        per_sample[first.current_sample_idx].append(length)
        for cache, writer in zip(kv_caches.caches, writers):
            cache.store(*writer.kv)

    def _cached_condition(self, kv_caches: reference.GlmImageKVCache, batch: int) -> dict[str, Any]:
        """forward_sharded's condition arguments: every layer's cached keys and values (the reference's
        per-sample batching, its `get`), and each condition image's true length."""
        per_sample = self._condition_lens.get(kv_caches)
        if per_sample is None or len(per_sample) != len(kv_caches.caches[0].k_caches):
            raise ValueError("kv_caches in read mode must have been written by this model (a write-mode forward)")
        if any(lens != per_sample[0] for lens in per_sample[1:]):
            raise ValueError(f"every sample needs condition images of the same token counts, got {per_sample}")
        flat = []
        for cache in kv_caches.caches:
            cached = cache.k_caches[0]
            empty = cached.new_empty(batch, 0, *cached.shape[2:])
            flat.extend(cache.get(empty, empty))
        return {"condition_kv": tuple(flat), "condition_lens": tuple(per_sample[0])}

    def forward_sharded(
        self,
        *,
        hidden_states: torch.Tensor,  # latents [B, C, H, W]
        encoder_hidden_states: torch.Tensor,  # glyph embeddings [B, L, text_embed_dim]
        prior_token_id: torch.Tensor,  # [B, N] one per image token (or a shape that broadcasts to them: [1])
        prior_token_drop: torch.Tensor,  # bool, prior_token_id's shape (or its leading dims): True zeroes a prior
        timestep: torch.Tensor,
        target_size: torch.Tensor,
        crop_coords: torch.Tensor,
        rotary_cos: torch.Tensor,  # [N, head_dim]
        rotary_sin: torch.Tensor,
        attention_kwargs: dict[str, Any] | None,
        condition_kv: tuple[torch.Tensor, ...] = (),  # read: each layer's cached key and value shards, in turn
        condition_lens: tuple[int, ...] = (),  # the cached condition images' true token counts
        condition_out: list[ConditionWriter] | None = None,  # write: one per layer, gets its key and value shards
    ) -> torch.Tensor:
        """The per-step work on this rank's shards, tensors in and out (the runner may replay it as
        a CUDA graph; a call with a condition runs eagerly)."""
        batch, _, height, width = hidden_states.shape
        p = self.config.patch_size
        with sequence_parallel_context() as ctx:
            if condition_out is not None and encoder_hidden_states.shape[1] and ctx.enabled:
                # Text and image shards would be cached as one stream, padded in its middle.
                raise ValueError("a write-mode (condition) forward takes no text under sequence parallelism")
            layer_kv: list[Any] = list(condition_out or [None] * len(self.transformer_blocks))
            if condition_lens:
                names = [f"{CONDITION}{i}" for i in range(len(condition_lens))]
                local = [record_sharded_stream(name, n) for name, n in zip(names, condition_lens)]
                for i in range(len(self.transformer_blocks)):
                    keys = condition_kv[2 * i].split(local, dim=1)
                    values = condition_kv[2 * i + 1].split(local, dim=1)
                    layer_kv[i] = ConditionKV(tuple(zip(names, keys, values)))
            patches = _patchify(hidden_states, p)
            image = self.image_projector.proj(shard_with_auto_pad(patches, 1, IMAGE))
            tokens = patches.shape[:2]
            per_token = prior_token_id.shape == tokens
            if per_token:  # one prior token per image token (the pipeline's): each rank embeds its own
                prior_token_id = shard_with_auto_pad(prior_token_id, 1, IMAGE)
                if prior_token_drop.shape == tokens:
                    prior_token_drop = shard_with_auto_pad(prior_token_drop, 1, IMAGE)
            prior = self.prior_token_embedding(prior_token_id)
            # x * 0.0 as the reference's in-place `prior[drop] *= 0.0` (drop indexes leading dims), no host sync.
            keep = ~prior_token_drop.reshape(*prior_token_drop.shape, *[1] * (prior.ndim - prior_token_drop.ndim))
            prior = self.prior_projector(prior * keep)
            if not per_token:
                # Other shapes (one id per sample) broadcast over the image tokens, as in the reference's sum.
                prior = shard_with_auto_pad(torch.broadcast_to(prior, (*tokens, prior.shape[-1])), 1, IMAGE)
            image = image + prior
            rotary = (shard_with_auto_pad(rotary_cos, 0, IMAGE), shard_with_auto_pad(rotary_sin, 0, IMAGE))
            text = self.glyph_projector(shard_with_auto_pad(encoder_hidden_states, 1, TEXT))
            temb = self.time_condition_embed(timestep, target_size, crop_coords, image.dtype)

            for block, kv in zip(self.transformer_blocks, layer_kv):
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    image, text = self._gradient_checkpointing_func(
                        block, image, text, temb, rotary, None, attention_kwargs, kv
                    )
                else:
                    image, text = block(image, text, temb, rotary, None, attention_kwargs, kv_cache=kv)

            image = gather_sequence(self.proj_out(self.norm_out(image, temb)), 1, IMAGE)

        image = image.reshape(batch, height // p, width // p, -1, p, p)
        return image.permute(0, 3, 1, 4, 2, 5).flatten(4, 5).flatten(2, 3)
