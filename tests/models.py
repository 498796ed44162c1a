"""Small model factories shared by tests (random weights, built from configs, no downloads)."""
from __future__ import annotations

import torch

from tailorfx.models import LlamaConfig, LlamaLM

VOCAB = 512


def tiny_llama(num_layers: int = 2, tied: bool = False, **kw) -> LlamaLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=tied, **kw)
    return LlamaLM(cfg)


def hf_llama(num_layers: int = 2, attn: str = "sdpa"):
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM
    cfg = HFLlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                        attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def hf_gpt2(num_layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=num_layers, n_head=4, n_positions=256,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def batch(B: int = 2, S: int = 40, pad: int = 0, seed: int = 0) -> dict:
    """input_ids and labels; the last `pad` labels of each row are -100 (padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    if pad:
        labels[:, -pad:] = -100
    return {"input_ids": ids, "labels": labels}
