"""Z-Image's transformer with Ulysses sequence parallelism.

`ZImageTransformer2DModel` is diffusers' class of the same name (same config, same parameter
names, so `from_pretrained` reads the diffusers checkpoint as is) with an SP forward: the image
and caption streams are sharded with the shared SP helper, and every block's attention processor
runs our `JointAttention` layer. The reference pads each stream to a multiple of 32 with a learned
pad token that attention sees like any token, so those tokens stay part of the streams; SP padding
goes past them. Three kinds of block share one class: the noise refiner attends within the image
stream, the context refiner within the caption stream, and the main layers over one [image, text]
sequence, which each rank holds as [its image shard, its text shard] and splits at the rank's
image length before attention (text joined "rear"). Rows of one image size share a forward, their captions
of any lengths (the reference masks the batch padding between them; here each row attends to its own caption
tokens, the attention layer's per-row keys); rows of other image sizes run as groups of their own. The Omni variant's
inputs (nested lists, SigLIP features) run diffusers' own forward, at one rank only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers import transformer_z_image as reference
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
from vllm_omni.diffusion.models.rotary import rotate_pairs

BLOCK_STREAMS = {"noise_refiner": IMAGE, "context_refiner": TEXT, "layers": "joint"}


class ZImageSPAttnProcessor(reference.ZSingleStreamAttnProcessor):
    """Projections, QK-norm and rotary as in the reference, then the shared (Ulysses) attention layer.

    `stream`: what the block's tokens are: the image stream, the text stream, or "joint" ([image, text]).
    A call with an attention mask (the reference's forward, for rows of different lengths) runs the
    reference processor; at one rank only.
    """

    def __init__(self, stream: str) -> None:
        super().__init__()
        self.stream = stream
        self.attention = JointAttention(text_position="rear") if stream == "joint" else JointAttention(stream=stream)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx = get_sp_context()
        sharded = ctx is not None and ctx.enabled
        if attention_mask is not None:
            if sharded:
                raise ValueError("Z-Image's SP forward attends to every token; padding is the attention layer's")
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:
            freqs = freqs_cis.unsqueeze(2)  # [B or 1, S, 1, D/2]: every head
            query, key = rotate_pairs(query, freqs), rotate_pairs(key, freqs)

        if self.stream == "joint" and ctx is not None and IMAGE in ctx.streams:
            # Split at the rank's image length, so each stream's padding stays at its own global tail and each
            # row's caption filler (rows of other lengths) is cut.
            n = ctx.streams[IMAGE].local_seq_len
            img_out, txt_out = self.attention(
                query[:, :n], key[:, :n], value[:, :n], text_qkv=(query[:, n:], key[:, n:], value[:, n:])
            )
            out = torch.cat([img_out, txt_out], dim=1)
        else:
            out, _ = self.attention(query, key, value)
        out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        if len(attn.to_out) > 1:  # dropout
            out = attn.to_out[1](out)
        return out


class ZImageTransformer2DModel(SequenceParallelTransformer, reference.ZImageTransformer2DModel):
    """Diffusers' Z-Image transformer, sequence-parallel under an SP process group."""

    @functools.wraps(reference.ZImageTransformer2DModel.__init__)  # keeps the config signature for from_pretrained
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Installed like any diffusers processor, so a later `set_attn_processor` replaces them.
        for name, stream in BLOCK_STREAMS.items():
            for block in getattr(self, name):
                block.attention.set_processor(ZImageSPAttnProcessor(stream))

    @apply_lora_scale("joint_attention_kwargs")
    def forward(
        self,
        x: list[torch.Tensor] | list[list[torch.Tensor]],
        t: torch.Tensor,
        cap_feats: list[torch.Tensor] | list[list[torch.Tensor]],
        return_dict: bool = True,
        controlnet_block_samples: dict[int, torch.Tensor] | None = None,
        siglip_feats: list[list[torch.Tensor]] | None = None,
        image_noise_mask: list[list[int]] | None = None,
        patch_size: int = 2,
        f_patch_size: int = 1,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> Transformer2DModelOutput | tuple[list[torch.Tensor]]:
        """Same arguments and outputs as the diffusers reference (its Omni inputs at one rank only)."""
        if isinstance(x[0], list):
            return self.forward_reference(
                "Z-Image Omni inputs (nested image lists, siglip_feats)",
                x=x,
                t=t,
                cap_feats=cap_feats,
                return_dict=return_dict,
                controlnet_block_samples=controlnet_block_samples,
                siglip_feats=siglip_feats,
                image_noise_mask=image_noise_mask,
                patch_size=patch_size,
                f_patch_size=f_patch_size,
                joint_attention_kwargs=joint_attention_kwargs,
            )
        if patch_size not in self.all_patch_size or f_patch_size not in self.all_f_patch_size:
            raise ValueError(f"patch sizes ({patch_size}, {f_patch_size}) are not among the checkpoint's")
        # The reference's own patchify: each stream padded to a multiple of 32 with its pad positions.
        images, captions, sizes, image_ids, caption_ids, _, _ = self.patchify_and_embed(
            x, cap_feats, patch_size, f_patch_size
        )
        image_lens = [(f // f_patch_size) * (h // patch_size) * (w // patch_size) for f, h, w in sizes]
        # Rows of one image size share a forward; their captions may differ in length (a CFG step's prompt and
        # negative prompt): each row attends to its own caption tokens alone (the attention layer's per-row
        # keys), where the reference masks the batch padding between them.
        # A processor set later (diffusers' own) attends to every key it is given: its rows keep one caption length.
        per_row_keys = all(
            isinstance(block.attention.processor, ZImageSPAttnProcessor)
            for name in BLOCK_STREAMS
            for block in getattr(self, name)
        )
        groups: dict[tuple, list[int]] = {}
        for i in range(len(x)):
            caption = () if per_row_keys else (captions[i].shape[0],)
            groups.setdefault((sizes[i], images[i].shape[0], *caption), []).append(i)

        outputs: list[torch.Tensor | None] = [None] * len(x)
        for rows in groups.values():
            first = rows[0]
            caption_lens = [captions[i].shape[0] for i in rows]  # each padded to a multiple of 32 by the reference
            longest = rows[caption_lens.index(max(caption_lens))]
            # Image positions start after the row's padded caption: rows with captions of other lengths have
            # their own image rotary rows.
            image_freqs = [self.rope_embedder(image_ids[i]) for i in (rows if len(set(caption_lens)) > 1 else [first])]
            with sequence_parallel_context() as ctx:
                if ctx.enabled:
                    self.check_sequence_parallel_processors(
                        dict.fromkeys(BLOCK_STREAMS, "attention"), (ZImageSPAttnProcessor,)
                    )
                sample = self.run_sharded(
                    hidden_states=torch.stack([images[i] for i in rows]),
                    encoder_hidden_states=_stack_padded([captions[i] for i in rows]),
                    # Computed here, not in the graphed forward_sharded: the rope embedder keeps its tables on itself.
                    image_freqs=torch.stack(image_freqs),
                    # The reference keeps the first rows of the caption's ids, as many as its tokens (its pad tokens
                    # continue the caption's positions); the longest caption's cover every row's.
                    text_freqs=self.rope_embedder(caption_ids[longest][: captions[longest].shape[0]]),
                    image_len=image_lens[first],
                    text_lens=tuple(len(cap_feats[i]) for i in rows),
                    caption_lens=tuple(caption_lens),
                    timestep=t[rows] if t.dim() and t.shape[0] == len(x) else t,
                    patch_key=f"{patch_size}-{f_patch_size}",
                    controlnet_block_samples=_rows_of(controlnet_block_samples, rows, len(x)),
                )
            unpatched = self.unpatchify(list(sample.unbind(0)), [sizes[i] for i in rows], patch_size, f_patch_size)
            for i, out in zip(rows, unpatched):
                outputs[i] = out
        return Transformer2DModelOutput(sample=outputs) if return_dict else (outputs,)

    def forward_sharded(
        self,
        *,
        hidden_states: torch.Tensor,  # [B, X, patch] image patches, padded to a multiple of 32
        encoder_hidden_states: torch.Tensor,  # [B, C, cap_feat_dim] caption features, likewise
        image_freqs: torch.Tensor,  # [1 or B, X, head_dim / 2] complex rotary rows of the image tokens
        text_freqs: torch.Tensor,  # [C, head_dim / 2] and of the caption tokens
        image_len: int,  # real image tokens (the rest are the learned pad token)
        text_lens: tuple[int, ...],  # real caption tokens of each row (then the learned pad token)
        caption_lens: tuple[int, ...],  # each row's caption with its pad tokens (then the batch's filler)
        timestep: torch.Tensor,
        patch_key: str,
        controlnet_block_samples: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The per-step work on this rank's shards, every tensor an argument (the runner may replay it as a
        CUDA graph). Returns the image tokens' output [B, X, patch] (pad tokens included)."""
        adaln = self.t_embedder(timestep * self.t_scale).type_as(hidden_states)
        x = self.all_x_embedder[patch_key](shard_with_auto_pad(hidden_states, 1, IMAGE))
        x = self._with_pad_token(x, (image_len,), hidden_states.shape[1], IMAGE, self.x_pad_token)
        cap = self.cap_embedder(shard_with_auto_pad(encoder_hidden_states, 1, TEXT, caption_lens))
        cap = self._with_pad_token(cap, text_lens, encoder_hidden_states.shape[1], TEXT, self.cap_pad_token)
        x_freqs = shard_with_auto_pad(image_freqs, 1, IMAGE)
        cap_freqs = shard_with_auto_pad(text_freqs, 0, TEXT).unsqueeze(0)

        checkpointing = torch.is_grad_enabled() and self.gradient_checkpointing
        for layer in self.noise_refiner:
            x = self._run_block(checkpointing, layer, x, x_freqs, adaln)
        for layer in self.context_refiner:
            cap = self._run_block(checkpointing, layer, cap, cap_freqs)

        image_local = x.shape[1]
        unified = torch.cat([x, cap], dim=1)
        unified_freqs = torch.cat([x_freqs, cap_freqs.expand(x_freqs.shape[0], -1, -1)], dim=1)
        for index, layer in enumerate(self.layers):
            unified = self._run_block(checkpointing, layer, unified, unified_freqs, adaln)
            if controlnet_block_samples is not None and index in controlnet_block_samples:
                sample = controlnet_block_samples[index]
                num_image = hidden_states.shape[1]
                unified = unified + torch.cat(
                    [
                        shard_with_auto_pad(sample[:, :num_image], 1, IMAGE),
                        shard_with_auto_pad(sample[:, num_image : num_image + encoder_hidden_states.shape[1]], 1, TEXT),
                    ],
                    dim=1,
                )

        output = self.all_final_layer[patch_key](unified[:, :image_local], c=adaln)
        return gather_sequence(output, 1, IMAGE)

    def _run_block(self, checkpointing: bool, layer: torch.nn.Module, *args: Any) -> torch.Tensor:
        x, freqs, *adaln = args
        if checkpointing:
            return self._gradient_checkpointing_func(layer, x, None, freqs, *adaln)
        return layer(x, None, freqs, *adaln)

    @staticmethod
    def _with_pad_token(
        x: torch.Tensor, real_lens: tuple[int, ...], seq_len: int, stream: str, pad_token: torch.Tensor
    ) -> torch.Tensor:
        """`x` with the stream's own pad positions (past each row's real length, one for every row or one per row)
        set to the learned pad token, as the reference."""
        if min(real_lens) == seq_len:
            return x
        positions = shard_with_auto_pad(torch.arange(seq_len, device=x.device), 0, stream)
        # [1 or B, local length], compared with host ints: no copy to the device (inside a CUDA graph's capture).
        pads = torch.stack([positions >= n for n in real_lens])
        return torch.where(pads.unsqueeze(-1), pad_token, x)


def _stack_padded(captions: list[torch.Tensor]) -> torch.Tensor:
    """Rows of different lengths as one [B, longest, ...] batch, zeros past each (filler attention never sees)."""
    longest = max(caption.shape[0] for caption in captions)
    return torch.stack([torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[0])) for c in captions])


def _rows_of(samples: dict[int, torch.Tensor] | None, rows: list[int], batch: int) -> dict[int, torch.Tensor] | None:
    """The controlnet residuals of `rows` (each [B, S, dim] over the reference's joint sequence)."""
    if samples is None or len(rows) == batch:
        return samples
    return {index: sample[rows] for index, sample in samples.items()}
