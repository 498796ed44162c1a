"""Sequence packing: tokenized documents into rows of a fixed token budget, for causal-LM training.

    collate = PackingCollator(seq_len=2048, pad_id=0)
    batch = collate(docs)            # docs: lists (or 1-D tensors) of token ids
    loss = model(**{k: v for k, v in batch.items() if k != "document_ids"}).loss

What a packed batch holds (B rows of S = seq_len tokens):

* ``input_ids`` (B, S): the documents of each row one after another, then ``pad_id``.
* ``labels`` (B, S): a copy of ``input_ids`` with -100 at padding and at the FIRST token of every
  document. transformers' causal-LM loss shifts labels left inside the loss (``labels[t]`` is the
  target of the prediction made at position ``t - 1``), so the -100 on a document's first token is
  what stops the last token of the previous document in the row from predicting it: no loss crosses
  a document join. A document of n tokens contributes n - 1 targets, as it does on its own.
* ``position_ids`` (B, S): 0, 1, 2, ... restarting at 0 for each document (and for the padding).
* ``document_ids`` (B, S) int64: which input document each token came from (its index in the list
  given to the collator, or in the corpus for ``PackedBatches``), -1 on padding. Not a model input:
  drop it before calling the model (``tailorfx.runtime.train.train`` does).
* ``use_cache``: False (``use_cache=None`` leaves the key out, for models that do not take it).

No ``attention_mask``, on purpose, and ``use_cache=False``. transformers 5.x
(``masking_utils._preprocess_mask_arguments`` / ``find_packed_sequence_indices``) turns restarting
``position_ids`` into a block-diagonal causal mask -- each token attends only to earlier tokens of
its own document -- ONLY when the 2-D ``attention_mask`` is None AND no KV cache is passed. Passing
an attention mask (even all ones) switches that detection off, and so does the cache: the models'
``use_cache`` defaults to ``config.use_cache`` (True for most configs, in training mode too), and
``LlamaModel.forward`` etc. then create a ``DynamicCache`` before building the mask -- documents
would attend across joins. With ``attention_mask=None``, ``use_cache=False`` and these
``position_ids``, the loss and gradients of a packed batch equal those of running each document on
its own (tests/test_training.py checks Llama sdpa and eager, and Qwen2; by hand also Mistral, Qwen3,
Gemma2 (eager), OLMo2, StarCoder2, Falcon, Phi-3, GPT-NeoX and GPT-2). RoPE (or GPT-2's learned
positions) reads the same ``position_ids``, so each document also sees the positions it would see
alone. A model that builds its mask without ``create_causal_mask(position_ids=...)`` (custom or
older modeling code) is not isolated by this format: check it as the test does.

A document longer than ``seq_len`` is split into pieces of at most ``seq_len`` tokens; each piece is
placed like a document (positions from 0, first label -100), so the target crossing a cut is lost.

``PackingStats`` compares the fraction of real tokens in packed rows with pad-to-longest batching of
the same documents (``pad_to_longest``), which is what packing saves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

import torch

IGNORE_INDEX = -100
STRATEGIES = ("first_fit", "sequential", "concat")

Document = Union[Sequence[int], torch.Tensor]


def _tokens(doc: Document) -> List[int]:
    if isinstance(doc, torch.Tensor):
        if doc.dim() != 1:
            raise ValueError(f"a document is a 1-D sequence of token ids, got a tensor of shape {tuple(doc.shape)}")
        return doc.tolist()
    return [int(t) for t in doc]


@dataclass(frozen=True)
class Piece:
    """A run of one document's tokens placed in a row."""
    doc: int              # index of the document it came from
    tokens: tuple         # its token ids


def split_documents(documents: Iterable[Document], seq_len: int) -> List[Piece]:
    """Each document as pieces of at most `seq_len` tokens, in order (empty documents dropped)."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} is not valid: a positive int")
    pieces = []
    for i, doc in enumerate(documents):
        toks = _tokens(doc)
        for start in range(0, len(toks), seq_len):
            pieces.append(Piece(i, tuple(toks[start:start + seq_len])))
    return pieces


def pack(documents: Iterable[Document], seq_len: int, strategy: str = "first_fit") -> List[List[Piece]]:
    """Place documents into rows of at most `seq_len` tokens; returns the rows, each a list of pieces.

    strategy:
      "first_fit"  -- each piece (in order) goes into the first row with room for it, else a new row
                      (rows keep their creation order; deterministic);
      "sequential" -- rows are filled in order: a piece that does not fit closes the row;
      "concat"     -- documents concatenated and cut every `seq_len` tokens (only the last row has
                      padding; documents are cut at row boundaries as well).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not valid: one of {STRATEGIES}")
    if strategy == "concat":
        rows: List[List[Piece]] = [[]]
        room = seq_len
        for i, doc in enumerate(documents):
            toks = _tokens(doc)
            while toks:
                if room == 0:
                    rows.append([])
                    room = seq_len
                take, toks = toks[:room], toks[room:]
                rows[-1].append(Piece(i, tuple(take)))
                room -= len(take)
        return [r for r in rows if r]
    rows, used = [], []
    for piece in split_documents(documents, seq_len):
        n = len(piece.tokens)
        if strategy == "first_fit":
            for r, u in enumerate(used):
                if u + n <= seq_len:
                    rows[r].append(piece)
                    used[r] += n
                    break
            else:
                rows.append([piece])
                used.append(n)
        else:  # sequential
            if used and used[-1] + n <= seq_len:
                rows[-1].append(piece)
                used[-1] += n
            else:
                rows.append([piece])
                used.append(n)
    return rows


def collate_rows(rows: Sequence[Sequence[Piece]], seq_len: int, pad_id: int = 0,
                 use_cache: Optional[bool] = False) -> dict:
    """input_ids, labels, position_ids and document_ids (B, seq_len) of packed rows (see module doc)."""
    B = len(rows)
    input_ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((B, seq_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((B, seq_len), dtype=torch.long)
    document_ids = torch.full((B, seq_len), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for piece in row:
            n = len(piece.tokens)
            if at + n > seq_len:
                raise ValueError(f"row {b} holds more than seq_len={seq_len} tokens")
            toks = torch.tensor(piece.tokens, dtype=torch.long)
            input_ids[b, at:at + n] = toks
            labels[b, at + 1:at + n] = toks[1:]          # the first token is nobody's target here
            position_ids[b, at:at + n] = torch.arange(n)
            document_ids[b, at:at + n] = piece.doc
            at += n
        # padding: positions restart at 0 too (its own segment, causally after every document)
        position_ids[b, at:] = torch.arange(seq_len - at)
    out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": document_ids}
    if use_cache is not None:
        out["use_cache"] = use_cache
    return out


def pad_to_longest(documents: Sequence[Document], pad_id: int = 0, max_len: Optional[int] = None) -> dict:
    """One row per document (pieces of at most `max_len` tokens when given), right-padded to the
    longest: input_ids, labels (-100 at padding and at each row's first token, which is never a
    target), attention_mask (B, L)."""
    if max_len is not None:
        toks = [list(p.tokens) for p in split_documents(documents, max_len)]
    else:
        toks = [t for t in (_tokens(d) for d in documents) if t]
    L = max((len(t) for t in toks), default=0)
    B = len(toks)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    for b, t in enumerate(toks):
        n = len(t)
        row = torch.tensor(t, dtype=torch.long)
        input_ids[b, :n] = row
        labels[b, 1:n] = row[1:]
        attention_mask[b, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@dataclass(frozen=True)
class PackingStats:
    """Real tokens against the token slots of packed rows and of pad-to-longest batching.

    `packed_slots`: rows x seq_len of the packed batches. `padded_slots`: the same documents (cut
    into the same pieces of at most seq_len), `batch_size` pieces per batch in order, each batch
    padded to its longest piece (one batch of all pieces when batch_size is None).
    """
    documents: int
    pieces: int
    rows: int
    seq_len: int
    real_tokens: int       # tokens of the documents
    target_tokens: int     # tokens that are a loss target (a piece of n tokens has n - 1)
    packed_slots: int
    padded_slots: int

    @property
    def packed_fraction(self) -> float:
        """Fraction of packed token slots that hold a real token."""
        return self.real_tokens / self.packed_slots if self.packed_slots else 0.0

    @property
    def padded_fraction(self) -> float:
        """Fraction of pad-to-longest token slots that hold a real token."""
        return self.real_tokens / self.padded_slots if self.padded_slots else 0.0

    @property
    def saving(self) -> float:
        """padded_slots / packed_slots: how many times fewer tokens packing computes on."""
        return self.padded_slots / self.packed_slots if self.packed_slots else 0.0

    def __str__(self) -> str:
        return (f"{self.documents} documents ({self.pieces} pieces, {self.real_tokens} tokens) -> {self.rows} rows "
                f"of {self.seq_len}: {self.packed_fraction:.1%} real tokens packed vs "
                f"{self.padded_fraction:.1%} padded to longest ({self.saving:.2f}x fewer slots)")


def packing_stats(documents: Sequence[Document], seq_len: int, batch_size: Optional[int] = None,
                  strategy: str = "first_fit") -> PackingStats:
    """PackingStats of packing `documents` into rows of `seq_len` (see PackingStats)."""
    documents = list(documents)
    rows = pack(documents, seq_len, strategy)
    pieces = split_documents(documents, seq_len)
    lengths = [len(p.tokens) for p in pieces]
    step = batch_size or max(len(lengths), 1)
    padded = sum(len(lengths[i:i + step]) * max(lengths[i:i + step]) for i in range(0, len(lengths), step))
    real = sum(lengths)
    return PackingStats(documents=len(documents), pieces=len(pieces), rows=len(rows), seq_len=seq_len,
                        real_tokens=real, target_tokens=sum(n - 1 for n in lengths),
                        packed_slots=len(rows) * seq_len, padded_slots=padded)


class PackingCollator:
    """Callable on a list of documents -> one packed batch (see the module docstring).

    Keeps running `stats` (a PackingStats over every call; the pad-to-longest comparison pads each
    call's pieces to that call's longest)."""

    def __init__(self, seq_len: int, pad_id: int = 0, strategy: str = "first_fit",
                 use_cache: Optional[bool] = False):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is not valid: one of {STRATEGIES}")
        self.seq_len, self.pad_id, self.strategy, self.use_cache = seq_len, pad_id, strategy, use_cache
        self.stats = PackingStats(0, 0, 0, seq_len, 0, 0, 0, 0)

    def __call__(self, documents: Sequence[Document]) -> dict:
        documents = list(documents)
        rows = pack(documents, self.seq_len, self.strategy)
        s, n = self.stats, packing_stats(documents, self.seq_len, None, self.strategy)
        self.stats = PackingStats(s.documents + n.documents, s.pieces + n.pieces, s.rows + n.rows, self.seq_len,
                                  s.real_tokens + n.real_tokens, s.target_tokens + n.target_tokens,
                                  s.packed_slots + n.packed_slots, s.padded_slots + n.padded_slots)
        return collate_rows(rows, self.seq_len, self.pad_id, self.use_cache)


class PackedBatches(Sequence):
    """A corpus packed once into rows and grouped `batch_size` rows per batch: an indexable (hence
    resumable) data source for `train()`. `document_ids` index the corpus. With `shuffle`, the
    rows are permuted with a generator seeded by `seed` (deterministic)."""

    def __init__(self, documents: Sequence[Document], seq_len: int, batch_size: int, pad_id: int = 0,
                 strategy: str = "first_fit", shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 use_cache: Optional[bool] = False):
        documents = list(documents)
        self.seq_len, self.batch_size, self.pad_id, self.use_cache = seq_len, batch_size, pad_id, use_cache
        self.rows = pack(documents, seq_len, strategy)
        if shuffle:
            order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(seed)).tolist()
            self.rows = [self.rows[i] for i in order]
        n = len(self.rows) // batch_size if drop_last else -(-len(self.rows) // batch_size)
        self._len = n
        self.stats = packing_stats(documents, seq_len, batch_size, strategy)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return collate_rows(self.rows[i * self.batch_size:(i + 1) * self.batch_size], self.seq_len, self.pad_id,
                            self.use_cache)
