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


# Tiny configs of transformers causal-LM families (random weights, dropout off). Each entry:
# model_type -> overrides of the common sizes below. Exercises dense, GQA, MoE, soft-capping,
# logit scaling, tied embeddings, parallel blocks and GPT-2's Conv1D.
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               pad_token_id=0, bos_token_id=0, eos_token_id=0)
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "phi3": {},
    "olmo2": {},
    "stablelm": {"hidden_dropout": 0.0, "attention_dropout": 0.0},
    "starcoder2": {"residual_dropout": 0.0, "embedding_dropout": 0.0, "attention_dropout": 0.0},
    "gpt_neox": {"hidden_dropout": 0.0, "attention_dropout": 0.0, "num_key_value_heads": None},
    "falcon": {"hidden_dropout": 0.0, "attention_dropout": 0.0, "num_key_value_heads": None},
    # eager attention, which soft-caps its scores (transformers 5.25's default for Gemma-2; 5.17, the GPU
    # machines', picks SDPA, which leaves the soft-cap out)
    "gemma2": {"head_dim": 16, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "query_pre_attn_scalar": 16, "attn_implementation": "eager"},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16},
    "cohere": {"logit_scale": 0.5},
    "granite": {"logits_scaling": 8.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.015625},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 64},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "bloom": {"hidden_dropout": 0.0, "attention_dropout": 0.0},   # ALiBi; its MLP adds the residual it is given
    "seed_oss": {"residual_dropout": 0.0, "attention_dropout": 0.0},
    "gpt2": None,   # its own field names, see hf_family
}


def hf_config(family: str, num_layers: int = 2, **overrides):
    """A tiny transformers config of `family` (a FAMILIES key)."""
    from transformers import AutoConfig
    if family == "gpt2":
        from transformers import GPT2Config
        kw = dict(vocab_size=VOCAB, n_embd=64, n_layer=num_layers, n_head=4, n_positions=2048,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2Config(**{**kw, **overrides})
    kw = {**_COMMON, **FAMILIES[family], "num_hidden_layers": num_layers, **overrides}
    kw = {k: v for k, v in kw.items() if v is not None}
    return AutoConfig.for_model(family, **kw)


def hf_family(family: str, num_layers: int = 2, seed: int = 0, **overrides):
    """A tiny transformers causal LM of `family`, fp32, random weights, train mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(family, num_layers, **overrides)).train()
