"""TRL's SFTTrainer under a memory budget: hand SFTTrainer the module optimize() returns.

TRL puts its fused LM head on the model it is given (add_fused_lm_head); tailorfx serves those
calls with the backbone's rewritten graph and one chunked log-prob head of its own, planned under
the budget (opt.report() says so). Its default gradient_checkpointing=True runs as tailorfx's
recompute pass.

    python examples/trl_sft.py [--tiny]
"""
import sys
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import SFTConfig, SFTTrainer

import tailorfx

tiny = "--tiny" in sys.argv
V, S = 4096, (64 if tiny else 1024)
config = Qwen2Config(vocab_size=V, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)
torch.manual_seed(0)
model = Qwen2ForCausalLM(config)
# token ids already: a word-level tokenizer over them gives TRL its pad and eos tokens
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(V)}, "t0")),
                                    pad_token="t0", eos_token="t1", unk_token="t0")
lengths = torch.randint(S // 4, S, (32,))
data = Dataset.from_list([{"input_ids": torch.randint(2, V, (int(n),)).tolist()} for n in lengths])

# plan for the rows TRL feeds (packing puts a batch in one row); a budget that leaves half of the
# activations of the step as captured
batch = {"input_ids": torch.randint(2, V, (1, 4 * S))}
batch["labels"] = batch["input_ids"]
plain = tailorfx.optimize(model, passes=[], example_inputs=batch).predict_memory()
try:
    opt = tailorfx.optimize(model, budget=plain.static_bytes + (plain.peak_bytes - plain.static_bytes) // 2,
                            example_inputs=batch)
except tailorfx.BudgetError as e:           # names the smallest budget any plan meets
    print(e)
    opt = tailorfx.optimize(model, budget=e.suggested_bytes, example_inputs=batch)
with tempfile.TemporaryDirectory() as out:
    args = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_length=S, max_steps=2 if tiny else 10,
                     logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=False)
    SFTTrainer(model=opt, args=args, train_dataset=data, processing_class=tokenizer).train()
print(opt.report())
