"""FLUX.2's transformer with Ulysses sequence parallelism.

`Flux2Transformer2DModel` is diffusers' class of the same name (same config, same parameter
names, so `from_pretrained` reads the diffusers checkpoint as is) with two changes: `forward`
shards the image and text streams with the shared SP helper and gathers the image output,
and each block's attention processor runs our `JointAttention` layer instead of a local kernel.

Layout per rank: the double-stream blocks keep the two streams apart (text, image); the
single-stream blocks hold one fused [text, image] sequence, so their processor splits it at
the rank's text length before attention and each stream keeps its padding at its own global
tail. The rotary tables are passed in the reference's layout ([text, image], here rank-local),
so at one rank the blocks see exactly the reference's inputs, and diffusers' own processors
(set with `set_attn_processor`) still compute the reference there.

The klein KV mode (`kv_cache_mode`: "extract" at the first step, the reference images' tokens in
front of the image's; "cached" after, the image alone) makes the reference tokens a third stream,
sharded with the same rule and attending only to themselves (`JointAttention.attend_reference`).
Our processors take the KV arguments as diffusers' KV processors do (without them they are the
default ones) and keep each layer's reference keys and values in its `Flux2KVLayerCache`: under SP,
this rank's heads after the all-to-all, as the layout placed them, so later steps exchange nothing
for them and trim/mask apply as at the first step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux2 as reference
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.attention.layer import QKV, JointAttention, ReferenceKV
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    REFERENCE,
    TEXT,
    gather_sequence,
    get_sp_context,
    record_sharded_stream,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.diffusion.models.family import SequenceParallelTransformer

# diffusers' own helpers for the projections and the klein KV modulation blends (private: diffusers_compat.py).
_get_qkv_projections = diffusers_compat.reference_function("transformer_flux2", "get_qkv_projections")
_blend_double_block_mods = diffusers_compat.reference_function("transformer_flux2", "blend_double_block_mods")
_blend_single_block_mods = diffusers_compat.reference_function("transformer_flux2", "blend_single_block_mods")

Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), [S, head_dim] each


def _split_rotary(rotary: Rotary, text_len: int) -> tuple[Rotary, Rotary]:
    """The [text, image] tables as (text, image) views."""
    cos, sin = rotary
    return (cos[:text_len], sin[:text_len]), (cos[text_len:], sin[text_len:])


def _local_len(stream: str, default: int) -> int:
    """This rank's tokens of `stream` (padding included); `default` outside our forward's SP context."""
    ctx = get_sp_context()
    return ctx.streams[stream].local_seq_len if ctx is not None and stream in ctx.streams else default


def _reference_mode(kv_cache: reference.Flux2KVLayerCache | None, kv_cache_mode: str | None, num_ref_tokens: int):
    """ "extract", "cached" or None, by the rule of diffusers' KV processors."""
    if kv_cache_mode == "extract" and num_ref_tokens > 0:
        return "extract"
    if kv_cache_mode == "cached" and kv_cache is not None:
        return "cached"
    return None


def _attend_reference(
    attention: JointAttention,
    mode: str,
    kv_cache: reference.Flux2KVLayerCache | None,
    ref_len: int,
    qkv: QKV,
    text_qkv: QKV | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KV mode's attention; `qkv` is the image stream with its first `ref_len` tokens the reference
    ones (extract) or none (cached). Returns the image stream's output (reference rows first) and the text's."""
    if mode == "cached":
        kept = ReferenceKV(*kv_cache.get())
        img_out, txt_out, _ = attention.attend_reference(*qkv, text_qkv, kept)
        return img_out, txt_out
    kept = ReferenceKV()
    ref_qkv = tuple(t[:, :ref_len] for t in qkv)
    img_out, txt_out, ref_out = attention.attend_reference(
        *(t[:, ref_len:] for t in qkv), text_qkv, kept, reference_qkv=ref_qkv
    )
    if kv_cache is not None:
        kv_cache.store(kept.key, kept.value)
    return torch.cat([ref_out, img_out], dim=1), txt_out


class Flux2SPAttnProcessor:
    """Double-stream blocks: projections, QK-norm and rotary per stream as in the reference, then joint attention."""

    def __init__(self) -> None:
        self.attention = JointAttention(text_position="front")

    def __call__(
        self,
        attn: reference.Flux2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Rotary | None = None,
        kv_cache: reference.Flux2KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise ValueError("FLUX.2 attends to every token; SP padding is handled by the attention layer")
        query, key, value, txt_query, txt_key, txt_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))

        text_qkv = None
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            txt_query = attn.norm_added_q(txt_query.unflatten(-1, (-1, attn.head_dim)))
            txt_key = attn.norm_added_k(txt_key.unflatten(-1, (-1, attn.head_dim)))
            txt_value = txt_value.unflatten(-1, (-1, attn.head_dim))
            if image_rotary_emb is not None:
                txt_rotary, image_rotary_emb = _split_rotary(image_rotary_emb, encoder_hidden_states.shape[1])
                txt_query = apply_rotary_emb(txt_query, txt_rotary, sequence_dim=1)
                txt_key = apply_rotary_emb(txt_key, txt_rotary, sequence_dim=1)
            text_qkv = (txt_query, txt_key, txt_value)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        mode = _reference_mode(kv_cache, kv_cache_mode, num_ref_tokens)
        if mode is None:
            img_out, txt_out = self.attention(query, key, value, text_qkv=text_qkv)
        else:
            ref_len = _local_len(REFERENCE, num_ref_tokens) if mode == "extract" else 0
            img_out, txt_out = _attend_reference(self.attention, mode, kv_cache, ref_len, (query, key, value), text_qkv)
        img_out = attn.to_out[1](attn.to_out[0](img_out.flatten(2, 3).to(query.dtype)))
        if txt_out is None:
            return img_out
        return img_out, attn.to_add_out(txt_out.flatten(2, 3).to(query.dtype))


class Flux2SPParallelSelfAttnProcessor:
    """Single-stream blocks: fused QKV + MLP projection as in the reference; attention over both streams."""

    def __init__(self) -> None:
        self.attention = JointAttention(text_position="front")

    def __call__(
        self,
        attn: reference.Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Rotary | None = None,
        kv_cache: reference.Flux2KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("FLUX.2 attends to every token; SP padding is handled by the attention layer")
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)

        query, key, value = qkv.chunk(3, dim=-1)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        ctx = get_sp_context()
        mode = _reference_mode(kv_cache, kv_cache_mode, num_ref_tokens)
        if mode is not None:
            # [text, (reference,) image] on this rank: the text's and the reference's local lengths split it.
            text_len = _local_len(TEXT, num_txt_tokens)
            ref_len = _local_len(REFERENCE, num_ref_tokens) if mode == "extract" else 0
            text_qkv = (query[:, :text_len], key[:, :text_len], value[:, :text_len])
            image_qkv = (query[:, text_len:], key[:, text_len:], value[:, text_len:])
            img_out, txt_out = _attend_reference(self.attention, mode, kv_cache, ref_len, image_qkv, text_qkv)
            attn_output = torch.cat([txt_out, img_out], dim=1)
        elif ctx is None or not ctx.enabled or TEXT not in ctx.streams:
            attn_output, _ = self.attention(query, key, value)
        else:
            # Split at the rank's text length, so each stream's padding stays at its own global tail.
            text_len = ctx.streams[TEXT].local_seq_len
            img_out, txt_out = self.attention(
                query[:, text_len:],
                key[:, text_len:],
                value[:, text_len:],
                text_qkv=(query[:, :text_len], key[:, :text_len], value[:, :text_len]),
            )
            attn_output = torch.cat([txt_out, img_out], dim=1)
        attn_output = attn_output.flatten(2, 3).to(query.dtype)

        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([attn_output, mlp_hidden_states], dim=-1))


_SP_PROCESSORS = (Flux2SPAttnProcessor, Flux2SPParallelSelfAttnProcessor)


class Flux2Transformer2DModel(SequenceParallelTransformer, reference.Flux2Transformer2DModel):
    """Diffusers' FLUX.2 transformer, sequence-parallel under an SP process group."""

    @functools.wraps(reference.Flux2Transformer2DModel.__init__)  # keeps the config signature for from_pretrained
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.use_sequence_parallel_processors()

    def use_sequence_parallel_processors(self) -> None:
        """Install our processors on every block (as at construction), in place of any set since."""
        # Installed like any diffusers processor, so a later `set_attn_processor` replaces them.
        for block in self.transformer_blocks:
            block.attn.set_processor(Flux2SPAttnProcessor())
        for block in self.single_transformer_blocks:
            block.attn.set_processor(Flux2SPParallelSelfAttnProcessor())

    @apply_lora_scale("joint_attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        timestep: torch.LongTensor = None,
        img_ids: torch.Tensor = None,
        txt_ids: torch.Tensor = None,
        guidance: torch.Tensor = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        kv_cache: reference.Flux2KVCache | None = None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
        ref_fixed_timestep: float = 0.0,
    ) -> torch.Tensor | Flux2Transformer2DModelOutput:
        """Same arguments and outputs as the diffusers reference, its klein KV cache included."""
        reference_kv: dict[str, Any] = {}  # forward_sharded's KV arguments, only where the KV mode applies
        if kv_cache_mode == "extract" and num_ref_tokens > 0:
            kv_cache = reference.Flux2KVCache(len(self.transformer_blocks), len(self.single_transformer_blocks))
            kv_cache.num_ref_tokens = num_ref_tokens
            reference_kv = dict(kv_cache=kv_cache, kv_cache_mode="extract", ref_fixed_timestep=ref_fixed_timestep)
        elif kv_cache_mode == "cached" and kv_cache is not None:
            reference_kv = dict(kv_cache=kv_cache, kv_cache_mode="cached")
        with sequence_parallel_context() as ctx:
            if ctx.enabled:
                self.check_sequence_parallel_processors(
                    {"transformer_blocks": "attn", "single_transformer_blocks": "attn"}, _SP_PROCESSORS
                )
            output = self.run_sharded(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                timestep=timestep,
                img_ids=img_ids,
                txt_ids=txt_ids,
                guidance=guidance,
                joint_attention_kwargs=joint_attention_kwargs,
                **reference_kv,
            )
        if kv_cache_mode == "extract":
            return (
                Flux2Transformer2DModelOutput(sample=output, kv_cache=kv_cache) if return_dict else (output, kv_cache)
            )
        return Flux2Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def forward_sharded(
        self,
        *,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None,
        joint_attention_kwargs: dict[str, Any] | None,
        kv_cache: reference.Flux2KVCache | None = None,
        kv_cache_mode: str | None = None,
        ref_fixed_timestep: float = 0.0,
    ) -> torch.Tensor:
        """The per-step work on this rank's shards, every tensor an argument (the runner may replay it as a
        CUDA graph). In the klein KV mode it fills or reads `kv_cache` (an object: such calls run eagerly):
        "extract", `hidden_states` is [reference, image] with `kv_cache.num_ref_tokens` reference tokens;
        "cached", the image alone."""
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = self.time_guidance_embed(timestep, guidance)
        double_stream_mod_img = self.double_stream_modulation_img(temb)
        double_stream_mod_txt = self.double_stream_modulation_txt(temb)
        single_stream_mod = self.single_stream_modulation(temb)

        # Positions are shared by the batch, as in the reference; each rank builds the rows of its tokens.
        if img_ids.ndim == 3:
            img_ids = img_ids[0]
        if txt_ids.ndim == 3:
            txt_ids = txt_ids[0]
        extract = kv_cache_mode == "extract"
        if extract:
            # The reference tokens lead the input; they become a stream of their own, padded at its own tail.
            num_ref = kv_cache.num_ref_tokens
            ref_hidden_states = self.x_embedder(shard_with_auto_pad(hidden_states[:, :num_ref], 1, REFERENCE))
            ref_cos, ref_sin = self.pos_embed(shard_with_auto_pad(img_ids[:num_ref], 0, REFERENCE))
            hidden_states, img_ids = hidden_states[:, num_ref:], img_ids[num_ref:]
            # The reference tokens are modulated at a fixed timestep (diffusers' blend: reference rows first).
            ref_temb = self.time_guidance_embed(torch.full_like(timestep, ref_fixed_timestep * 1000), guidance)
        elif kv_cache_mode == "cached":
            record_sharded_stream(REFERENCE, kv_cache.num_ref_tokens)  # kept: attention holds its heads
        num_txt_tokens = encoder_hidden_states.shape[1]

        hidden_states = self.x_embedder(shard_with_auto_pad(hidden_states, 1, IMAGE))
        encoder_hidden_states = self.context_embedder(shard_with_auto_pad(encoder_hidden_states, 1, TEXT))
        img_cos, img_sin = self.pos_embed(shard_with_auto_pad(img_ids, 0, IMAGE))
        txt_cos, txt_sin = self.pos_embed(shard_with_auto_pad(txt_ids, 0, TEXT))
        ref_len = 0  # this rank's reference tokens, padding included
        if extract:
            ref_len = ref_hidden_states.shape[1]
            hidden_states = torch.cat([ref_hidden_states, hidden_states], dim=1)
            img_cos, img_sin = torch.cat([ref_cos, img_cos], dim=0), torch.cat([ref_sin, img_sin], dim=0)
            double_stream_mod_img = _blend_double_block_mods(
                double_stream_mod_img, self.double_stream_modulation_img(ref_temb), ref_len, hidden_states.shape[1]
            )
        rotary = (torch.cat([txt_cos, img_cos], dim=0), torch.cat([txt_sin, img_sin], dim=0))

        # The KV processors' arguments, as diffusers passes them (global token counts; ours read the local ones).
        kv_kwargs = None
        if kv_cache_mode is not None:
            kv_kwargs = {
                **(joint_attention_kwargs or {}),
                "kv_cache_mode": kv_cache_mode,
                "num_ref_tokens": kv_cache.num_ref_tokens,
            }

        checkpointing = torch.is_grad_enabled() and self.gradient_checkpointing
        for index, block in enumerate(self.transformer_blocks):
            block_kwargs = (
                joint_attention_kwargs if kv_kwargs is None else {**kv_kwargs, "kv_cache": kv_cache.get_double(index)}
            )
            if checkpointing:
                encoder_hidden_states, hidden_states = self._gradient_checkpointing_func(
                    block,
                    hidden_states,
                    encoder_hidden_states,
                    double_stream_mod_img,
                    double_stream_mod_txt,
                    rotary,
                    block_kwargs,
                )
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    temb_mod_img=double_stream_mod_img,
                    temb_mod_txt=double_stream_mod_txt,
                    image_rotary_emb=rotary,
                    joint_attention_kwargs=block_kwargs,
                )

        text_len = encoder_hidden_states.shape[1]  # this rank's text tokens, padding included
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        if extract:
            single_stream_mod = _blend_single_block_mods(
                single_stream_mod, self.single_stream_modulation(ref_temb), text_len, ref_len, hidden_states.shape[1]
            )
        for index, block in enumerate(self.single_transformer_blocks):
            block_kwargs = joint_attention_kwargs
            if kv_kwargs is not None:
                block_kwargs = {**kv_kwargs, "num_txt_tokens": num_txt_tokens, "kv_cache": kv_cache.get_single(index)}
            if checkpointing:
                hidden_states = self._gradient_checkpointing_func(
                    block, hidden_states, None, single_stream_mod, rotary, block_kwargs
                )
            else:
                hidden_states = block(
                    hidden_states=hidden_states,
                    encoder_hidden_states=None,
                    temb_mod=single_stream_mod,
                    image_rotary_emb=rotary,
                    joint_attention_kwargs=block_kwargs,
                )
        hidden_states = hidden_states[:, text_len + ref_len :]

        output = self.proj_out(self.norm_out(hidden_states, temb))
        return gather_sequence(output, 1, IMAGE)
