"""``SentenceEncoder``: a BERT sentence encoder (all-MiniLM-L6-v2 and any sentence-transformers folder of a BERT
model with mean pooling) in plain PyTorch, loaded from the folder's ``config.json`` and ``model.safetensors``.

Written out rather than taken from ``transformers`` so that its ONNX export is a small, fixed graph (input ids and
attention mask in, token states out) and the text tower runs on onnxruntime alone; its output equals
sentence-transformers' on the same folder (``tests/text/test_text_encoder.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from retrieval.errors import ParameterError

MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class EncoderConfig:
    """The fields of a BERT ``config.json`` the encoder is built from."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def read(cls, folder: Path) -> EncoderConfig:
        """The folder's config.json, checked: a BERT model with GELU activations and absolute positions."""
        path = folder / "config.json"
        if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
            raise ParameterError("text_encoder", f"{folder} holds no config.json of a sentence-transformers model")
        raw = json.loads(path.read_text())
        if raw.get("model_type") != "bert" or raw.get("hidden_act", "gelu") != "gelu" \
                or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ParameterError("text_encoder", f"{folder} is a {raw.get('model_type')!r} model; the text tower "
                                                 "reads BERT encoders (all-MiniLM-L6-v2 and its kind)")
        try:
            config = cls(**{name: raw[name] for name in cls.__dataclass_fields__})
        except KeyError as exc:
            raise ParameterError("text_encoder", f"{path} lacks {exc}") from None
        if config.hidden_size % config.num_attention_heads:
            raise ParameterError("text_encoder", f"{path}: hidden_size is not a multiple of the heads")
        return config


class SelfAttention(nn.Module):
    """Multi-head self-attention with BERT's parameter names (query, key, value)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.size = config.hidden_size // config.num_attention_heads
        self.scale = 1.0 / math.sqrt(self.size)  # a constant, so the exported graph holds no shape arithmetic
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, states: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        batch, length, width = states.shape

        def split(x: torch.Tensor) -> torch.Tensor:  # [B, L, W] -> [B, H, L, W/H]
            return x.view(batch, length, self.heads, self.size).transpose(1, 2)

        q, k, v = split(self.query(states)), split(self.key(states)), split(self.value(states))
        scores = (q @ k.transpose(-1, -2)) * self.scale + additive_mask
        context = torch.softmax(scores, dim=-1) @ v
        return context.transpose(1, 2).reshape(batch, length, width)


class Block(nn.Module):
    """One BERT layer: attention and feed-forward, each with a residual and a post-LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = SelfAttention(config)
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, states: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        attended = self.attention.output.dense(self.attention.self(states, additive_mask))
        states = self.attention.output.LayerNorm(attended + states)
        hidden = nn.functional.gelu(self.intermediate.dense(states))
        return self.output.LayerNorm(self.output.dense(hidden) + states)


def _additive(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask [B, L] as the additive mask [B, 1, 1, L] the scores take (padding: the lowest value)."""
    return ((1.0 - attention_mask.to(dtype)) * torch.finfo(dtype).min)[:, None, None, :]


class SentenceEncoder(nn.Module):
    """Token ids [B, L] and attention mask [B, L] -> the mean of the unmasked tokens' last states [B, hidden]."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embeddings.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embeddings.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embeddings.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))

    @property
    def width(self) -> int:
        return self.config.hidden_size

    @classmethod
    def from_folder(cls, folder: str | Path) -> SentenceEncoder:
        """The encoder of a sentence-transformers folder (config.json, model.safetensors), weights loaded."""
        from safetensors.torch import load_file

        folder = Path(folder)
        encoder = cls(EncoderConfig.read(folder))
        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise ParameterError("text_encoder", f"{folder} holds no model.safetensors")
        skipped = ("pooler.", "embeddings.position_ids")  # BERT's pooler is not a sentence-transformers output
        state = {k: v for k, v in load_file(str(weights)).items() if not k.startswith(skipped)}
        state = {k.removeprefix("bert."): v for k, v in state.items()}
        missing, unexpected = encoder.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ParameterError("text_encoder", f"{weights} is not this BERT's weights: missing {missing[:3]}, "
                                                 f"unexpected {unexpected[:3]}")
        return encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        layers = len(self.encoder.layer)
        return self.upper(self.lower(input_ids, attention_mask, layers), attention_mask, layers)

    def lower(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, stop: int) -> torch.Tensor:
        """The token states [B, L, width] after the first ``stop`` blocks (what a tower that tunes only the blocks
        above computes once)."""
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0)
        states = (self.embeddings.word_embeddings(input_ids) + self.embeddings.position_embeddings(positions)
                  + self.embeddings.token_type_embeddings(torch.zeros_like(input_ids)))
        states = self.embeddings.LayerNorm(states)
        additive = _additive(attention_mask, states.dtype)
        for block in list(self.encoder.layer)[:stop]:
            states = block(states, additive)
        return states

    def upper(self, states: torch.Tensor, attention_mask: torch.Tensor, start: int) -> torch.Tensor:
        """The blocks from ``start`` on over ``states``, then the mean of the unmasked tokens [B, width]."""
        additive = _additive(attention_mask, states.dtype)
        for block in list(self.encoder.layer)[start:]:
            states = block(states, additive)
        weights = attention_mask.to(states.dtype).unsqueeze(-1)
        return (states * weights).sum(1) / weights.sum(1).clamp_min(1e-9)  # mean pooling, sentence-transformers'

    def trainable_top(self, layers: int) -> list[nn.Parameter]:
        """Freeze all but the top ``layers`` blocks; their parameters (none for 0)."""
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        top = list(self.encoder.layer)[len(self.encoder.layer) - layers:] if layers > 0 else []
        params = [p for block in top for p in block.parameters()]
        for parameter in params:
            parameter.requires_grad_(True)
        return params
