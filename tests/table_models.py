"""A hand-written causal LM whose position tables are built once at a maximum length and sliced to
the sequence, as many models write them (MPT's ALiBi, GPT-2's and GPT-J's masks, rotary caches):
the attention pass must prove and swap its attention as if the tables were built at the length.

Forms (`TableLM(form=...)`):
- "mask": an additive causal mask, an M x M table (-inf above the diagonal) sliced [:S, :S];
- "alibi": a per-key ALiBi bias, an (H, 1, M) table sliced to its last S keys as MPT does
  ([..., max(0, M - S):]), with a boolean causal M x M table sliced [:S, :S] filled in;
Both slice a rotary cos/sin cache of M positions to the first S: computed in forward ("mask") or
built in __init__ as non-persistent buffers ("alibi", as older rotary caches are kept).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tailorfx.models.llama import CausalLMOutput as Output, rotate_half

FORMS = ("mask", "alibi")
# "shifted": the mask table sliced one row down ([1:S + 1, :S]), so query i sees key i + 1: a
# table form that is not causal, which the proof must refuse
ALL_FORMS = FORMS + ("shifted",)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.heads)
        if bias is not None:
            scores = (scores + bias).masked_fill(mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
        a = F.softmax(scores, dim=-1) @ v
        return self.out(a.transpose(1, 2).reshape(B, S, D))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn, self.mlp = Attention(hidden, heads), MLP(hidden)

    def forward(self, x, cos, sin, mask, bias):
        x = x + self.attn(self.ln1(x), cos, sin, mask, bias)
        return x + self.mlp(self.ln2(x))


class TableLM(nn.Module):
    """forward(input_ids, labels=None) -> Output(loss, logits); tables of length `max_len`."""

    def __init__(self, vocab: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 256, form: str = "mask"):
        super().__init__()
        if form not in ALL_FORMS:
            raise ValueError(f"form {form!r}: one of {ALL_FORMS}")
        self.form, self.max_len, self.heads, self.head_dim = form, max_len, heads, hidden // heads
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if form == "alibi":
            cos, sin = self._rotary(torch.device("cpu"))
            self.register_buffer("cos_cached", cos, persistent=False)
            self.register_buffer("sin_cached", sin, persistent=False)

    def _rotary(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        ang = torch.outer(torch.arange(self.max_len, device=device).float(), inv)
        emb = torch.cat((ang, ang), dim=-1)
        return emb.cos(), emb.sin()

    def _tables(self, S: int, device: torch.device):
        M = self.max_len
        if self.form in ("mask", "shifted"):
            cos, sin = self._rotary(device)
            table = torch.full((M, M), float("-inf"), device=device).triu(1)
            return cos[:S], sin[:S], table[:S, :S] if self.form == "mask" else table[1:S + 1, :S], None
        cos, sin = self.cos_cached[:S], self.sin_cached[:S]
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.heads + 1, device=device).float() / self.heads)
        alibi = (torch.arange(1 - M, 1, device=device).float().view(1, 1, M) * slopes.view(-1, 1, 1))
        hidden = ~torch.ones(M, M, dtype=torch.bool, device=device).tril()
        return cos, sin, hidden[:S, :S], alibi[:, :, max(0, M - S):]

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Output:
        x = self.embed(input_ids)
        cos, sin, mask, bias = self._tables(input_ids.shape[1], input_ids.device)
        for block in self.blocks:
            x = block(x, cos, sin, mask, bias)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return Output(logits=logits)
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]   # each position predicts the next token
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)
        return Output(loss=loss, logits=logits)
