"""Qwen-Image's transformer with Ulysses sequence parallelism.

`QwenImageTransformer2DModel` is diffusers' class of the same name (same config, same
parameter names, so `from_pretrained` reads the diffusers checkpoint as is) with two
changes: `forward` shards the token streams with the shared SP helper and gathers the
output, and each block's attention processor runs our `JointAttention` layer instead of a
local kernel. Every other op in a block works token by token, so it runs unchanged on a
rank's slice. The diffusers pipelines call it exactly like the reference.
"""

from __future__ import annotations

import functools
from math import prod
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers import transformer_qwenimage as reference
from diffusers.utils import apply_lora_scale

from vllm_omni.diffusion.attention.layer import JointAttention
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    gather_sequence,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.diffusion.models.family import SequenceParallelTransformer
from vllm_omni.diffusion.models.rotary import rotate_pairs
from vllm_omni.diffusion.models.text_compaction import compact_text_mask, compact_text_rows


def qk_rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """diffusers' QK RMSNorm, bit for bit, in fewer ops: at Ulysses 2+ a layer is bound by launch time."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps).to(norm.weight.dtype) * norm.weight


class QwenImageSPAttnProcessor:
    """Projections, QK-norm and rotary as in the reference, then the shared (Ulysses) attention layer."""

    def __init__(self) -> None:
        self.attention = JointAttention(text_position="front")

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states_mask is not None or attention_mask is not None:
            raise ValueError("masks are resolved in QwenImageTransformer2DModel.forward (text compaction)")
        head_dim = attn.inner_dim // attn.heads
        img_q = qk_rms_norm(attn.to_q(hidden_states).unflatten(-1, (-1, head_dim)), attn.norm_q)
        img_k = qk_rms_norm(attn.to_k(hidden_states).unflatten(-1, (-1, head_dim)), attn.norm_k)
        img_v = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        txt_q = qk_rms_norm(attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim)), attn.norm_added_q)
        txt_k = qk_rms_norm(attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim)), attn.norm_added_k)
        txt_v = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = (freqs.unsqueeze(1) for freqs in image_rotary_emb)  # [S, 1, D/2]: every head
            img_q, img_k = rotate_pairs(img_q, img_freqs), rotate_pairs(img_k, img_freqs)
            txt_q, txt_k = rotate_pairs(txt_q, txt_freqs), rotate_pairs(txt_k, txt_freqs)

        img_out, txt_out = self.attention(img_q, img_k, img_v, text_qkv=(txt_q, txt_k, txt_v))
        img_out = attn.to_out[0](img_out.flatten(2, 3))
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.flatten(2, 3))


def rotary_tables(
    pos_embed: torch.nn.Module, img_shapes: list, text_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's rotary tables (`QwenEmbedRope`, or `QwenEmbedLayer3DRope` for layered
    checkpoints), with text rows past their fixed 4096 positions computed as needed.

    The reference precomputes 4096 positions and slices the text's rows from just after the
    image's largest index: a longer text gets fewer rotary rows than it has tokens, silently,
    and fails later (an edit prompt of about 4000 tokens at 1024x1024). The missing rows use the
    reference's own formula, on the forward's device (no host copy).
    """
    img_freqs, txt_freqs = pos_embed(img_shapes, max_txt_seq_len=text_len, device=device)
    missing = text_len - txt_freqs.shape[0]
    if missing > 0:
        if txt_freqs.shape[0] == 0:
            rows = pos_embed.pos_freqs.shape[0]
            raise ValueError(f"image grid {img_shapes} is beyond the rotary table's {rows} rows")
        start = pos_embed.pos_freqs.shape[0]  # the text's rows were cut at the table's end
        with torch.device(txt_freqs.device):
            index = torch.arange(start, start + missing)
            extra = torch.cat([pos_embed.rope_params(index, dim, pos_embed.theta) for dim in pos_embed.axes_dim], dim=1)
        txt_freqs = torch.cat([txt_freqs, extra])
    return img_freqs, txt_freqs


class CallProcessorDirectly(ModelHook):
    """Runs an attention module's processor without diffusers' `Attention.forward`, which inspects the
    processor's signature on every call (at Ulysses 2+ a layer is bound by host-side launch time).

    A diffusers hook on each block's `attn`; it reads `attn.processor` at each call, so
    `set_attn_processor` still takes effect.
    """

    NAME = "vllm_omni.qwen_image.call_processor"

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return module.processor(module, *args, **kwargs)


class QwenImageTransformer2DModel(SequenceParallelTransformer, reference.QwenImageTransformer2DModel):
    """Diffusers' Qwen-Image transformer, sequence-parallel under an SP process group."""

    @functools.wraps(reference.QwenImageTransformer2DModel.__init__)  # keeps the config signature for from_pretrained
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for block in self.transformer_blocks:
            block.attn.set_processor(QwenImageSPAttnProcessor())
            registry = HookRegistry.check_if_exists_or_initialize(block.attn)
            registry.register_hook(CallProcessorDirectly(), CallProcessorDirectly.NAME)

    @apply_lora_scale("attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        timestep: torch.Tensor = None,
        img_shapes: list | None = None,
        guidance: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        controlnet_block_samples: list[torch.Tensor] | None = None,
        additional_t_cond: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """Same arguments and outputs as the diffusers reference."""
        # The reference masks padded text keys; keeping only the valid tokens (and their rotary
        # rows) gives the same image output with no mask, so the dense kernel still runs.
        mask = encoder_hidden_states_mask
        compaction = None if mask is None else compact_text_mask(mask)
        if compaction is None:
            plans = [(slice(None), None, None)]
        elif not isinstance(compaction, list):  # every row's mask alike: one compaction
            plans = [(slice(None), compaction.index, compaction.valid_len)]
        elif (rows := compact_text_rows(mask)).shared_index is not None:
            # Prompts of different lengths: one forward, each row's attention seeing its own valid text.
            plans = [(slice(None), rows.shared_index, rows.valid_lens)]
        else:
            # Valid tokens that do not lead a row's mask would need rotary rows per row: one by one.
            plans = [(slice(i, i + 1), row.index, row.valid_len) for i, row in enumerate(compaction)]
        outputs = []
        for row, text_index, text_valid_len in plans:
            row_shapes = img_shapes[row] if img_shapes is not None else None
            # Computed here, not in the graphed forward_sharded: diffusers keeps these tables in an
            # evicting cache, and a CUDA graph must own what it reads (as arguments, it copies them).
            img_freqs, txt_freqs = rotary_tables(
                self.pos_embed, row_shapes, encoder_hidden_states.shape[1], hidden_states.device
            )
            with sequence_parallel_context():
                outputs.append(
                    self.run_sharded(
                        hidden_states=hidden_states[row],
                        encoder_hidden_states=encoder_hidden_states[row],
                        img_freqs=img_freqs,
                        txt_freqs=txt_freqs,
                        text_index=text_index,
                        text_valid_len=text_valid_len,
                        timestep=timestep[row] if timestep.dim() else timestep,
                        img_shapes=row_shapes,
                        guidance=guidance[row] if guidance is not None and guidance.dim() else guidance,
                        attention_kwargs=attention_kwargs,
                        controlnet_block_samples=[s[row] for s in controlnet_block_samples]
                        if controlnet_block_samples
                        else None,
                        additional_t_cond=additional_t_cond[row] if additional_t_cond is not None else None,
                    )
                )
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def forward_sharded(
        self,
        *,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        img_freqs: torch.Tensor,  # rotary rows of the image tokens (`rotary_tables`)
        txt_freqs: torch.Tensor,  # and of the text tokens, before compaction
        text_index: torch.Tensor | None,  # the compacted text's positions (valid first, then bucket filler)
        text_valid_len: int | tuple[int, ...] | None,  # None: keep every text token; a tuple: each row's
        timestep: torch.Tensor,
        img_shapes: list,
        guidance: torch.Tensor | None,
        attention_kwargs: dict[str, Any] | None,
        controlnet_block_samples: list[torch.Tensor] | None,
        additional_t_cond: torch.Tensor | None,
    ) -> torch.Tensor:
        """The per-step work on this rank's shards, with every tensor an argument (the runner may
        replay it as a CUDA graph); `forward` resolves the text mask into `text_index` first."""
        if text_index is not None:
            encoder_hidden_states = encoder_hidden_states.index_select(1, text_index)
            txt_freqs = txt_freqs.index_select(0, text_index)

        hidden_states = self.img_in(shard_with_auto_pad(hidden_states, 1, IMAGE))
        encoder_hidden_states = shard_with_auto_pad(encoder_hidden_states, 1, TEXT, valid_len=text_valid_len)
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))
        rotary = (shard_with_auto_pad(img_freqs, 0, IMAGE), shard_with_auto_pad(txt_freqs, 0, TEXT))

        timestep = timestep.to(hidden_states.dtype)
        modulate_index = None
        if self.zero_cond_t:
            # Edit-2511: the first image (the one being generated) uses the timestep, the
            # reference images timestep 0; the index picks per token and travels with the image stream.
            timestep = torch.cat([timestep, timestep * 0], dim=0)
            # Built on the device (no host copy, so CUDA graphs can capture it): 0 for the
            # generated image's tokens, 1 for the reference images' tokens.
            positions = torch.arange(img_freqs.shape[0], device=timestep.device)
            modulate_index = torch.stack([(positions >= prod(sample[0])).int() for sample in img_shapes])
            modulate_index = shard_with_auto_pad(modulate_index, 1, IMAGE)

        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = (
            self.time_text_embed(timestep, hidden_states, additional_t_cond)
            if guidance is None
            else self.time_text_embed(timestep, guidance, hidden_states, additional_t_cond)
        )

        for index_block, block in enumerate(self.transformer_blocks):
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=None,
                temb=temb,
                image_rotary_emb=rotary,
                joint_attention_kwargs=attention_kwargs,
                modulate_index=modulate_index,
            )
            if controlnet_block_samples is not None:
                interval = int(np.ceil(len(self.transformer_blocks) / len(controlnet_block_samples)))
                sample = controlnet_block_samples[index_block // interval]
                hidden_states = hidden_states + shard_with_auto_pad(sample, 1, IMAGE)

        if self.zero_cond_t:
            temb = temb.chunk(2, dim=0)[0]
        output = self.proj_out(self.norm_out(hidden_states, temb))
        return gather_sequence(output, 1, IMAGE)
