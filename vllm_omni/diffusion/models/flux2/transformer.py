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
(set with `set_attn_processor`) still compute the reference there. The klein KV mode (`kv_cache`,
`kv_cache_mode`: reference-image keys and values kept across steps) runs diffusers' own forward,
at one rank only; under SP it is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux2 as reference
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from vllm_omni.diffusion.attention.layer import JointAttention
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    gather_sequence,
    get_sp_context,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.diffusion.models.family import SequenceParallelTransformer

Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), [S, head_dim] each


def _split_rotary(rotary: Rotary, text_len: int) -> tuple[Rotary, Rotary]:
    """The [text, image] tables as (text, image) views."""
    cos, sin = rotary
    return (cos[:text_len], sin[:text_len]), (cos[text_len:], sin[text_len:])


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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise ValueError("FLUX.2 attends to every token; SP padding is handled by the attention layer")
        query, key, value, txt_query, txt_key, txt_value = reference._get_qkv_projections(
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

        img_out, txt_out = self.attention(query, key, value, text_qkv=text_qkv)
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
        if ctx is None or not ctx.enabled or TEXT not in ctx.streams:
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
        """Same arguments and outputs as the diffusers reference (its klein KV cache at one rank only)."""
        if kv_cache_mode is not None or kv_cache is not None:
            return self._forward_kv_cache(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                timestep=timestep,
                img_ids=img_ids,
                txt_ids=txt_ids,
                guidance=guidance,
                joint_attention_kwargs=joint_attention_kwargs,
                return_dict=return_dict,
                kv_cache=kv_cache,
                kv_cache_mode=kv_cache_mode,
                num_ref_tokens=num_ref_tokens,
                ref_fixed_timestep=ref_fixed_timestep,
            )
        with sequence_parallel_context() as ctx:
            if ctx.enabled:
                self._check_processors_are_sequence_parallel()
            output = self.run_sharded(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                timestep=timestep,
                img_ids=img_ids,
                txt_ids=txt_ids,
                guidance=guidance,
                joint_attention_kwargs=joint_attention_kwargs,
            )
        return Flux2Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def _forward_kv_cache(self, **kwargs: Any) -> Any:
        """The reference's forward with its reference-token KV cache (klein KV): one rank only, for now."""
        with sequence_parallel_context() as ctx:
            if ctx.enabled:
                raise NotImplementedError(
                    "the reference-token KV cache (FLUX.2 klein KV: kv_cache / kv_cache_mode) is not supported under "
                    f"sequence parallelism (degree {ctx.world_size}); it runs with sequence parallelism off"
                )
        # Diffusers' own forward; blocks run whichever processors are installed (the klein KV pipeline sets its own).
        return super().forward(**kwargs)

    def _check_processors_are_sequence_parallel(self) -> None:
        for name in ("transformer_blocks", "single_transformer_blocks"):
            blocks = getattr(self, name)
            for index, block in enumerate(blocks):
                if not isinstance(block.attn.processor, _SP_PROCESSORS):
                    raise RuntimeError(
                        f"{name}.{index}.attn has processor {type(block.attn.processor).__name__}, which attends "
                        "only to this rank's tokens; under sequence parallelism use Flux2SPAttnProcessor / "
                        "Flux2SPParallelSelfAttnProcessor (or subclasses)"
                    )

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
    ) -> torch.Tensor:
        """The per-step work on this rank's shards, every tensor an argument (the runner may replay it as a
        CUDA graph)."""
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = self.time_guidance_embed(timestep, guidance)
        double_stream_mod_img = self.double_stream_modulation_img(temb)
        double_stream_mod_txt = self.double_stream_modulation_txt(temb)
        single_stream_mod = self.single_stream_modulation(temb)

        hidden_states = self.x_embedder(shard_with_auto_pad(hidden_states, 1, IMAGE))
        encoder_hidden_states = self.context_embedder(shard_with_auto_pad(encoder_hidden_states, 1, TEXT))

        # Positions are shared by the batch, as in the reference; each rank builds the rows of its tokens.
        if img_ids.ndim == 3:
            img_ids = img_ids[0]
        if txt_ids.ndim == 3:
            txt_ids = txt_ids[0]
        img_cos, img_sin = self.pos_embed(shard_with_auto_pad(img_ids, 0, IMAGE))
        txt_cos, txt_sin = self.pos_embed(shard_with_auto_pad(txt_ids, 0, TEXT))
        rotary = (torch.cat([txt_cos, img_cos], dim=0), torch.cat([txt_sin, img_sin], dim=0))

        checkpointing = torch.is_grad_enabled() and self.gradient_checkpointing
        for block in self.transformer_blocks:
            if checkpointing:
                encoder_hidden_states, hidden_states = self._gradient_checkpointing_func(
                    block,
                    hidden_states,
                    encoder_hidden_states,
                    double_stream_mod_img,
                    double_stream_mod_txt,
                    rotary,
                    joint_attention_kwargs,
                )
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    temb_mod_img=double_stream_mod_img,
                    temb_mod_txt=double_stream_mod_txt,
                    image_rotary_emb=rotary,
                    joint_attention_kwargs=joint_attention_kwargs,
                )

        text_len = encoder_hidden_states.shape[1]  # this rank's text tokens, padding included
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for block in self.single_transformer_blocks:
            if checkpointing:
                hidden_states = self._gradient_checkpointing_func(
                    block, hidden_states, None, single_stream_mod, rotary, joint_attention_kwargs
                )
            else:
                hidden_states = block(
                    hidden_states=hidden_states,
                    encoder_hidden_states=None,
                    temb_mod=single_stream_mod,
                    image_rotary_emb=rotary,
                    joint_attention_kwargs=joint_attention_kwargs,
                )
        hidden_states = hidden_states[:, text_len:]

        output = self.proj_out(self.norm_out(hidden_states, temb))
        return gather_sequence(output, 1, IMAGE)
