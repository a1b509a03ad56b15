"""Qwen-Image 2.1's transformer with Ulysses sequence parallelism.

`QwenImage21Transformer2DModel` is diffusers' class of the same name (same config, same parameter
names) with an SP forward. Its one sequence is a prefix (text, with condition images in the
vision slots) and the target image; attention is block-causal: the prefix attends only to
itself (text causally, each condition image within itself), the target to everything. Here the
prefix is the text stream and the target the image stream, each sharded at its own tail; a rank
holds [target, prefix] in one tensor (the single-stream blocks run per token), and the attention
layer's `text_blocks` gives the prefix its block-causal runs. The reference's prefix KV cache
(`kv_cache`, `kv_cache_mode`) and processors other than ours (`set_attn_processor`) run diffusers'
own forward, at one rank only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers import transformer_qwenimage21 as reference
from diffusers.utils import apply_lora_scale

from vllm_omni.diffusion.attention.layer import JointAttention, TextBlocks
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    gather_sequence,
    get_sp_context,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.diffusion.models.family import SequenceParallelTransformer, declare_cache_block
from vllm_omni.diffusion.models.qwen_image.transformer import qk_rms_norm
from vllm_omni.diffusion.models.rotary import rotate_pairs
from vllm_omni.diffusion.models.text_compaction import cached_on_tensors, compact_tokens

# One output per block (the rank's [target, prefix] tokens): the step cache's residual keeps its shape.
declare_cache_block(reference.QwenImage21TransformerBlock, hidden_states_index=0, encoder_hidden_states_index=None)


class QwenImage21SPAttnProcessor:
    """Projections, QK-norm and rotary as in the reference, then the shared attention layer (block-causal prefix)."""

    def __init__(self) -> None:
        self.attention = JointAttention(text_position="front")

    def __call__(
        self,
        attn: reference.QwenImage21Attention,
        hidden_states: torch.Tensor,
        attention_mask: Any | None = None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache: reference.QwenImage21KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: TextBlocks | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx = get_sp_context()
        if ctx is None or IMAGE not in ctx.streams:
            # Called by diffusers' forward (its KV cache, or processors around ours; one rank): its layout.
            return reference.QwenImage21AttnProcessor()(
                attn, hidden_states, attention_mask, rotary_emb, layer_cache, kv_cache_mode, cache_write_slice,
                segments, key_valid,
            )  # fmt: skip
        head_dim = attn.inner_dim // attn.heads
        query = qk_rms_norm(attn.to_q(hidden_states).unflatten(-1, (-1, head_dim)), attn.norm_q)
        key = qk_rms_norm(attn.to_k(hidden_states).unflatten(-1, (-1, head_dim)), attn.norm_k)
        value = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        freqs = rotary_emb.unsqueeze(1)  # [S, 1, D/2]: every head
        query, key = rotate_pairs(query, freqs), rotate_pairs(key, freqs)

        n = ctx.streams[IMAGE].local_seq_len  # this rank's target tokens, then its prefix tokens
        img_out, txt_out = self.attention(
            query[:, :n],
            key[:, :n],
            value[:, :n],
            text_qkv=(query[:, n:], key[:, n:], value[:, n:]),
            text_blocks=segments,
        )
        out = torch.cat([img_out, txt_out], dim=1).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


@dataclass(frozen=True)
class SequencePlan:
    """Host facts of one forward's joint sequence (cached on the pipeline's mask tensors: no sync per step)."""

    prefix_index: torch.Tensor | None  # prefix tokens kept (valid, then bucket filler) -> rows of [text, cond images]
    positions: torch.Tensor | None  # their positions in the joint sequence (the prefix starts it); None: all, in order
    valid_len: int | None  # kept prefix tokens that are real (None: all)
    blocks: TextBlocks  # the prefix's block-causal runs over its kept real tokens
    prefix_freqs: torch.Tensor  # rotary rows of the kept prefix tokens
    target_freqs: torch.Tensor  # and of the target image's tokens
    joint_len: int


def _runs(image_ids: list[int]) -> TextBlocks:
    """(start, end, causal) runs of equal block ids (-1: text, causal; an image block: bidirectional)."""
    runs, start = [], 0
    for index in range(1, len(image_ids) + 1):
        if index == len(image_ids) or image_ids[index] != image_ids[start]:
            runs.append((start, index, image_ids[start] < 0))
            start = index
    return tuple(runs)


class QwenImage21Transformer2DModel(SequenceParallelTransformer, reference.QwenImage21Transformer2DModel):
    """Diffusers' Qwen-Image 2.1 transformer, sequence-parallel under an SP process group."""

    @functools.wraps(reference.QwenImage21Transformer2DModel.__init__)  # keeps the config signature for from_pretrained
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Installed like any diffusers processor, so a later `set_attn_processor` replaces them.
        for block in self.transformer_blocks:
            block.attn.set_processor(QwenImage21SPAttnProcessor())

    @apply_lora_scale("attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_shapes: list[list[tuple[int, int, int]]],
        img_mask: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        kv_cache: reference.QwenImage21KVCache | None = None,
        kv_cache_mode: str | None = None,
        return_dict: bool = True,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """Same arguments and outputs as the diffusers reference; the output's rows at masked (padded)
        prompt tokens are zeros (the reference fills them from queries nobody reads)."""
        kwargs = dict(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            timestep=timestep,
            img_shapes=img_shapes,
            img_mask=img_mask,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            attention_kwargs=attention_kwargs,
            kv_cache=kv_cache,
            kv_cache_mode=kv_cache_mode,
            return_dict=return_dict,
        )
        cached = kv_cache is not None or kv_cache_mode is not None
        ours = all(isinstance(block.attn.processor, QwenImage21SPAttnProcessor) for block in self.transformer_blocks)
        if cached:
            return self.forward_reference(
                "the prefix KV cache (kv_cache / kv_cache_mode; the pipeline's use_kv_cache=False turns it off)",
                **kwargs,
            )
        if not ours:
            return self.forward_reference(
                "attention processors other than QwenImage21SPAttnProcessor (they attend to one rank's tokens)",
                **kwargs,
            )

        mask = encoder_hidden_states_mask
        rows = [slice(None)] if mask is None or (mask.bool() == mask[:1].bool()).all() else range(mask.shape[0])
        outputs = []
        for row in rows:
            # Rows whose prompts are padded differently cannot share one compaction: they run one by one.
            plan = self._plan(img_shapes[0], img_mask, mask, 0 if isinstance(row, slice) else row, hidden_states.device)
            row = row if isinstance(row, slice) else slice(row, row + 1)
            with sequence_parallel_context():
                output = self.run_sharded(
                    hidden_states=hidden_states[row],
                    encoder_hidden_states=encoder_hidden_states[row],
                    prefix_index=plan.prefix_index,
                    prefix_valid_len=plan.valid_len,
                    prefix_blocks=plan.blocks,
                    prefix_freqs=plan.prefix_freqs,
                    target_freqs=plan.target_freqs,
                    timestep=timestep[row] if timestep.dim() else timestep,
                    attention_kwargs=attention_kwargs,
                )
            outputs.append(self._joint_output(output, plan))
        output = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def _plan(
        self, img_shapes: list, img_mask: torch.Tensor, text_mask: torch.Tensor | None, row: int, device: torch.device
    ) -> SequencePlan:
        """The joint sequence's layout as the reference builds it (`img_mask`'s first row), the masked prompt
        tokens of `text_mask[row]` dropped (text_compaction.py), its rotary rows; cached on the mask tensors."""

        def plan() -> SequencePlan:
            slots = img_mask[0].bool()
            per_slot = torch.where(slots, reference._IMG_TOKENS_PER_SLOT, 1)
            image_pad_mask = torch.repeat_interleave(slots, per_slot)
            joint_len = image_pad_mask.shape[0]
            target_len = math.prod(img_shapes[-1])
            prefix_len = joint_len - target_len
            if not image_pad_mask[prefix_len:].all():
                raise ValueError("the target image's tokens must end the joint sequence (img_mask's last slots)")
            freqs = self.pos_embed(img_shapes, image_pad_mask, device=device)
            image_ids, _ = self.build_token_metadata(image_pad_mask, img_shapes)
            # Where each prefix token comes from: a text row of encoder_hidden_states, or (vision slots)
            # the next condition-image latent, appended after the text rows.
            vlm_row = torch.repeat_interleave(torch.arange(slots.shape[0], device=slots.device), per_slot)
            image_rank = torch.cumsum(image_pad_mask.long(), 0) - 1
            text_rows = slots.shape[0] - target_len // reference._IMG_TOKENS_PER_SLOT
            source = torch.where(image_pad_mask, text_rows + image_rank, vlm_row)[:prefix_len]
            valid = torch.ones(prefix_len, dtype=torch.bool, device=slots.device)
            if text_mask is not None:
                text = ~image_pad_mask[:prefix_len]
                valid[text] = text_mask[row].bool()[vlm_row[:prefix_len][text]].to(valid.device)
            kept = None if valid.all() else compact_tokens(valid)
            ids = image_ids[:prefix_len].tolist()
            if kept is None:
                positions = None
                prefix_index = source.to(device) if image_pad_mask[:prefix_len].any() else None
                prefix_freqs = freqs[:prefix_len]
                blocks = _runs(ids)
            else:
                positions = kept.index.to(device)
                prefix_index = source.to(device).index_select(0, positions)
                prefix_freqs = freqs[:prefix_len].index_select(0, positions)
                blocks = _runs([ids[i] for i in kept.index[: kept.valid_len].tolist()])
            return SequencePlan(
                prefix_index=prefix_index,
                positions=positions,
                valid_len=None if kept is None else kept.valid_len,
                blocks=blocks,
                prefix_freqs=prefix_freqs,
                target_freqs=freqs[prefix_len:],
                joint_len=joint_len,
            )

        key = ("qwen_image21_plan", tuple(map(tuple, img_shapes)), row, str(device))
        return cached_on_tensors((img_mask, text_mask), key, plan)

    @staticmethod
    def _joint_output(output: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
        """forward_sharded's [prefix (kept real tokens first), target] rows at their joint positions."""
        target_len = plan.target_freqs.shape[0]
        if plan.positions is None:
            return output
        joint = output.new_zeros(output.shape[0], plan.joint_len, output.shape[2])
        joint[:, plan.joint_len - target_len :] = output[:, -target_len:]
        joint[:, plan.positions[: plan.valid_len]] = output[:, : plan.valid_len]
        return joint

    def forward_sharded(
        self,
        *,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        prefix_index: torch.Tensor | None,  # the prefix's rows of [text, condition images]; None: the text as is
        prefix_valid_len: int | None,  # of them, the real ones (the rest: bucket filler); None: all
        prefix_blocks: TextBlocks,
        prefix_freqs: torch.Tensor,
        target_freqs: torch.Tensor,
        timestep: torch.Tensor,
        attention_kwargs: dict[str, Any] | None,
    ) -> torch.Tensor:
        """The per-step work on this rank's shards, every tensor an argument (the runner may replay it as a
        CUDA graph). Returns [prefix, target] rows: the prefix's kept tokens (real ones first), the target's."""
        target_len = target_freqs.shape[0]
        condition_len = hidden_states.shape[1] - target_len
        target = self.img_in(shard_with_auto_pad(hidden_states[:, condition_len:], 1, IMAGE))
        if condition_len == 0:
            # Text only: every op before attention is per token, so the raw text is sharded first.
            text = encoder_hidden_states
            if prefix_index is not None:
                text = text.index_select(1, prefix_index)
            prefix = self.txt_in(shard_with_auto_pad(text, 1, TEXT, valid_len=prefix_valid_len))
        else:
            source = torch.cat([self.txt_in(encoder_hidden_states), self.img_in(hidden_states[:, :condition_len])], 1)
            prefix = shard_with_auto_pad(source.index_select(1, prefix_index), 1, TEXT, valid_len=prefix_valid_len)
        rotary = torch.cat(
            [shard_with_auto_pad(target_freqs, 0, IMAGE), shard_with_auto_pad(prefix_freqs, 0, TEXT, prefix_valid_len)]
        )

        timestep = timestep.to(target.dtype)
        target_token_mask = None
        if self.config.causal_condition:
            # The prefix modulates from t = 0 (the extra row), the target from its sample's timestep.
            timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
            target_token_mask = torch.cat(
                [
                    torch.ones(target.shape[1], dtype=torch.bool, device=target.device),
                    torch.zeros(prefix.shape[1], dtype=torch.bool, device=target.device),
                ]
            )
        temb = self.time_text_embed(timestep, target)
        modulation = self.modulation(temb)

        hidden_states = torch.cat([target, prefix], dim=1)
        for block in self.transformer_blocks:
            hidden_states = block(
                hidden_states=hidden_states,
                modulation=modulation,
                rotary_emb=rotary,
                target_token_mask=target_token_mask,
                segments=prefix_blocks,
            )
        output = self.proj_out(self.norm_out(hidden_states, temb, target_token_mask))
        n = target.shape[1]
        return torch.cat([gather_sequence(output[:, n:], 1, TEXT), gather_sequence(output[:, :n], 1, IMAGE)], dim=1)
