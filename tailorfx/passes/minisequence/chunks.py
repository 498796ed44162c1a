"""How many chunks a region runs in (a number, or a rule on the run-time length), and the record
of each rewrite the pass reports.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import annotate
from tailorfx.rewrite.regions import Region
from tailorfx.runtime.chunked_modules import chunk_count

NAME = "minisequence"
MAX_CHUNKS = 64
# Fewer tokens per chunk than this costs throughput (each chunk re-reads the weights and, for the
# LM head, re-accumulates a V x H weight gradient) for little memory: below it, fewer chunks.
MIN_CHUNK_TOKENS = 1024
MIN_SEGMENT_CHUNK_TOKENS = 256
SEGMENTS_HEAD_CHUNKS = 4096   # with segments the head chunks by MIN_SEGMENT_CHUNK_TOKENS alone (1M tokens)


@dataclass
class Rewrite:
    """One region the pass chunked, as the report shows it."""
    region: Region
    num_chunks: int
    saved_bytes: int
    logits_dropped: bool = False   # the model's logits output became None (fused head)


def auto_chunks(intermediate_bytes: int, io_bytes: int) -> int:
    """Enough chunks that one chunk's intermediates are no larger than the region's input."""
    if io_bytes <= 0:
        return 1
    return max(1, min(MAX_CHUNKS, math.ceil(intermediate_bytes / io_bytes)))


@dataclass(frozen=True)
class Chunking:
    """How M is chosen: `num_chunks` when given, else from the tokens, at least `min_tokens` a chunk."""
    num_chunks: Optional[int]
    min_tokens: int

    def count(self, gm: fx.GraphModule, x: fx.Node, seq_dim: int, ideal: int, before: fx.Node):
        """M: as given, else min(ideal, tokens // min_tokens) computed at run time from the
        (symbolic) length, so one graph chunks 2K and 64K tokens each sensibly."""
        if self.num_chunks:
            return self.num_chunks
        xv = node_value(x)
        other = math.prod(int(d) for i, d in enumerate(xv.shape[:seq_dim + 1]) if i != seq_dim)
        length = xv.shape[seq_dim]
        if not isinstance(length, torch.SymInt):
            return chunk_count(int(length) * other, ideal, None, self.min_tokens)
        g = gm.graph
        with g.inserting_before(before):
            n_len = g.call_method("size", (x, seq_dim))
            n_tok = g.call_function(operator.mul, (n_len, other))
            n_div = g.call_function(operator.floordiv, (n_tok, self.min_tokens))
            n_min = g.call_function(torch.sym_min, (ideal, n_div))
            n_max = g.call_function(torch.sym_max, (1, n_min))
        tok = length * other
        for node, val in ((n_len, length), (n_tok, tok), (n_div, tok // self.min_tokens),
                          (n_min, torch.sym_min(ideal, tok // self.min_tokens)),
                          (n_max, torch.sym_max(1, torch.sym_min(ideal, tok // self.min_tokens)))):
            annotate(node, val=val, pass_name=NAME)
        return n_max
