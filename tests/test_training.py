"""Packing and the training loop (tailorfx.runtime.packing, tailorfx.runtime.train.train).

* a packed batch trains exactly like its documents run one by one (loss and every gradient);
* k accumulated micro-batches equal one batch k times the size (num_items_in_batch);
* 20 steps + checkpoint + resume in fresh state + 20 steps == 40 steps, bit for bit;
* the JSON-lines log, the "tailorfx" logger and the progress bar;
* the packing layout and its real-token fractions, derived by hand.
"""
import json
import logging
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import VOCAB, batch, hf_family
from tailorfx.runtime.packing import (PackedBatches, PackingCollator, collate_rows, pack, pad_to_longest,
                                      packing_stats)
from tailorfx.runtime.train import accumulate, count_targets, lr_lambda, train


pytestmark = pytest.mark.usefixtures("one_thread")


def _docs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got, want, rtol):
    assert got.keys() == want.keys()
    for k in want:
        # rtol per element; atol for elements near zero, relative to the tensor's largest gradient
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=rtol * want[k].abs().max().item(), msg=k)


# ---- packed == unpacked ------------------------------------------------------------------------

@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_packed_batch_trains_like_separate_documents(family, attn):
    docs = _docs((7, 13, 5, 20, 9, 1, 11, 3))       # a 1-token document has no target
    packed = PackingCollator(seq_len=32)(docs)
    assert packed["input_ids"].shape[0] == 3 and "attention_mask" not in packed and packed["use_cache"] is False

    model = hf_family(family, num_layers=1, attn_implementation=attn)
    inputs = {k: v for k, v in packed.items() if k != "document_ids"}
    loss = model(**inputs).loss                      # transformers' mean over the counted labels
    loss.backward()
    got = _grads(model)

    # reference: each document alone (its own row, default positions), token-sum CE by hand
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for d in docs:
        ids = torch.tensor([d])
        logits = model(input_ids=ids).logits[0, :-1]
        total = total + F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")
        count += len(d) - 1
    assert count_targets(packed) == count == sum(len(d) - 1 for d in docs)
    ref = total / count
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=0)
    _assert_grads_close(got, _grads(model), rtol=1e-4)


def test_packed_isolation_needs_no_attention_mask_and_no_cache():
    """What the collator's docstring says: transformers builds the per-document mask from
    position_ids only when attention_mask is None and no KV cache is made (use_cache=False)."""
    docs = _docs((9, 14, 6))
    packed = PackingCollator(seq_len=32)(docs)
    model = hf_family("llama", num_layers=1).eval()
    inputs = {k: v for k, v in packed.items() if k != "document_ids"}
    with torch.no_grad():
        good = model(**inputs).logits
        with_mask = model(**inputs, attention_mask=torch.ones_like(packed["input_ids"])).logits
        with_cache = model(**{**inputs, "use_cache": True}).logits
        alone = model(input_ids=torch.tensor([docs[1]])).logits[0]
    second = slice(9, 23)      # the second document's tokens in row 0
    torch.testing.assert_close(good[0, second], alone, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(with_mask[0, second], alone, atol=1e-3)
    assert not torch.allclose(with_cache[0, second], alone, atol=1e-3)


# ---- the layout and the statistics, by hand ---------------------------------------------------

def test_packed_layout_by_hand():
    docs = [[11, 12, 13], [21, 22], [31, 32, 33, 34, 35, 36, 37]]      # the last one is split at 4
    b = PackingCollator(seq_len=4, pad_id=0)(docs)
    # first-fit: doc0 (3) opens row 0; doc1 (2) does not fit its 1 free slot -> row 1; doc2 is cut
    # into pieces of 4 and 3: the 4 opens row 2, the 3 fits neither row 0 (1 free) nor row 1 (2) -> row 3
    assert b["input_ids"].tolist() == [[11, 12, 13, 0], [21, 22, 0, 0], [31, 32, 33, 34], [35, 36, 37, 0]]
    assert b["labels"].tolist() == [[-100, 12, 13, -100], [-100, 22, -100, -100],
                                    [-100, 32, 33, 34], [-100, 36, 37, -100]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1], [0, 1, 2, 3], [0, 1, 2, 0]]
    assert b["document_ids"].tolist() == [[0, 0, 0, -1], [1, 1, -1, -1], [2, 2, 2, 2], [2, 2, 2, -1]]

    # two documents in one row: the second's first token is nobody's target, positions restart
    b = collate_rows(pack([[1, 2, 3], [4, 5], [6]], 8), 8, pad_id=9)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 9, 9]]
    assert b["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, -1, -1]]
    assert count_targets(b) == 3     # 2 of doc0 + 1 of doc1 + 0 of doc2

    # sequential closes a row when the next document does not fit; concat cuts at row ends
    assert [[len(p.tokens) for p in r] for r in pack([[1] * 3, [2] * 2, [3] * 1], 4, "sequential")] == [[3], [2, 1]]
    assert [[len(p.tokens) for p in r] for r in pack([[1] * 3, [2] * 2, [3] * 1], 4, "concat")] == [[3, 1], [1, 1]]
    assert [[len(p.tokens) for p in r] for r in pack([[1] * 3, [2] * 2, [3] * 1], 4, "first_fit")] == [[3, 1], [2]]

    p = pad_to_longest([[1, 2, 3], [4, 5]], pad_id=0)
    assert p["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert p["labels"].tolist() == [[-100, 2, 3], [-100, 5, -100]]
    assert p["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_packing_stats_by_hand():
    docs = [[1] * 5, [2] * 3, [3] * 8, [4] * 2]     # 18 real tokens, seq_len 8
    # first-fit rows: [5+3], [8], [2]  -> 3 rows x 8 = 24 slots -> 18/24 = 0.75
    # pad to longest, 2 per batch: [5,3] -> 2x5 = 10, [8,2] -> 2x8 = 16 -> 26 slots -> 18/26
    s = packing_stats(docs, seq_len=8, batch_size=2)
    assert (s.rows, s.real_tokens, s.target_tokens, s.packed_slots, s.padded_slots) == (3, 18, 14, 24, 26)
    assert s.packed_fraction == 0.75 and s.padded_fraction == 18 / 26 and s.saving == 26 / 24
    # one batch of all four, padded to 8: 32 slots
    collate = PackingCollator(seq_len=8)
    collate(docs)
    assert (collate.stats.packed_slots, collate.stats.padded_slots) == (24, 32)
    assert collate.stats.padded_fraction == 18 / 32
    # a document longer than a row counts as its pieces: 11 tokens at seq_len 4 -> 4, 4, 3; then 2.
    # first-fit rows [4], [4], [3], [2] (3 + 2 > 4) -> 16 slots; one batch of 4 pieces padded to 4 = 16
    s = packing_stats([[1] * 11, [2] * 2], seq_len=4, batch_size=4)
    assert (s.pieces, s.rows, s.real_tokens, s.packed_slots, s.padded_slots) == (4, 4, 13, 16, 16)
    assert s.packed_fraction == 13 / 16
    data = PackedBatches(docs, seq_len=8, batch_size=2)
    assert len(data) == 2 and data[1]["input_ids"].shape == (1, 8) and data.stats == packing_stats(docs, 8, 2)


def test_lr_schedule():
    f = lr_lambda("cosine", total_steps=10, warmup=2)
    assert [f(0), f(1), f(2), f(6), f(10)] == [0.0, 0.5, 1.0, pytest.approx(0.5), pytest.approx(0.0)]
    g = lr_lambda("linear", total_steps=10, warmup=0, min_lr_ratio=0.1)
    assert [g(0), g(5), g(10)] == [1.0, pytest.approx(0.55), pytest.approx(0.1)]


# ---- gradient accumulation ------------------------------------------------------------------

class MeanLoss(torch.nn.Module):
    """A module whose forward takes no num_items_in_batch: returns the mean token loss."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels):
        return self.inner(input_ids=input_ids, labels=labels).loss


def test_grad_accumulation_equals_one_big_batch():
    micro = [batch(B=2, S=16, pad=p, seed=i) for i, p in enumerate((0, 5, 11))]   # 30, 20, 8 targets
    big = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}
    assert [count_targets(m) for m in micro] == [30, 20, 8] and count_targets(big) == 58

    def grads(model, batches):
        model.zero_grad(set_to_none=True)
        loss, n = accumulate(model, batches)
        return loss, n, _grads(model)

    model = hf_family("llama", num_layers=1)
    loss_k, n_k, g_k = grads(model, micro)
    loss_1, n_1, g_1 = grads(model, [big])
    assert n_k == n_1 == 58
    torch.testing.assert_close(loss_k, loss_1, rtol=1e-5, atol=0)
    _assert_grads_close(g_k, g_1, rtol=1e-5)
    # the same through a module without num_items_in_batch (mean loss scaled by n_i / N)
    loss_m, _, g_m = grads(MeanLoss(model), micro)
    torch.testing.assert_close(loss_m, loss_1, rtol=1e-5, atol=0)
    _assert_grads_close({k[len("inner."):]: v for k, v in g_m.items()}, g_1, rtol=1e-5)
    # naive accumulation (mean of the micro-batch means) is not the big batch
    naive = sum(model(**m).loss for m in micro) / 3
    assert abs(naive.item() - loss_1.item()) > 1e-3

    # one optimizer step of train() (clipping on): parameters after it
    def step(batches, k, sgd=False):
        m = hf_family("llama", num_layers=1)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt = torch.optim.SGD(m.parameters(), lr=100.0) if sgd else None   # updates ~ weights
        r = train(m, batches, steps=1, grad_accum=k, lr=1e-3, weight_decay=0.1, optimizer=opt, progress=False)
        return r, {n: p.detach() for n, p in m.named_parameters()}, before

    for sgd in (True, False):
        r_k, p_k, before = step(micro, 3, sgd)
        r_1, p_1, _ = step([big], 1, sgd)
        assert r_k.losses[0] == pytest.approx(r_1.losses[0], rel=1e-5)
        assert r_k.records[0]["targets"] == r_1.records[0]["targets"] == 58
        assert r_k.records[0]["grad_norm"] == pytest.approx(r_1.records[0]["grad_norm"], rel=1e-5)
        for n in p_1:
            torch.testing.assert_close(p_k[n], p_1[n], rtol=1e-5, atol=1e-6, msg=n)
            if sgd:   # SGD's update is linear in the gradient: the updates themselves agree to 1e-5
                u_k, u_1 = p_k[n] - before[n], p_1[n] - before[n]
                torch.testing.assert_close(u_k, u_1, rtol=1e-5, atol=1e-5 * u_1.abs().max().item(), msg=n)
    # (AdamW's first update is ~ lr * sign(g): an element whose gradient is within rounding of 0
    # can move by a fraction of lr differently, hence atol=1e-6 = lr/1000 on the parameters)


# ---- checkpoint and resume ------------------------------------------------------------------

def _resume_data():
    docs = _docs([3 + (7 * i) % 29 for i in range(40)], seed=3)
    return PackedBatches(docs, seq_len=32, batch_size=2, shuffle=True, seed=0)


@pytest.mark.parametrize("precision", [None, "fp16"])
def test_resume_is_bit_for_bit(tmp_path, precision):
    n = 20 if precision is None else 4       # fp16 autocast on CPU is slower: a shorter run
    # attention dropout: the losses depend on the torch RNG, so its state must come back too
    make = lambda seed: hf_family("llama", num_layers=1, seed=seed, attention_dropout=0.1)  # noqa: E731
    kw = dict(total_steps=2 * n, grad_accum=2, lr=2e-3, warmup=3, weight_decay=0.1, precision=precision,
              progress=False)

    model = make(0)
    straight = train(model, _resume_data(), steps=2 * n, **kw)
    straight_params = {k: p.detach().clone() for k, p in model.state_dict().items()}
    straight_rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    first = train(make(0), _resume_data(), steps=n, checkpoint_dir=tmp_path, save_every=n // 2, **kw)
    assert [p.rsplit("/", 1)[-1] for p in first.checkpoints] == [f"step_{n // 2:08d}.pt", f"step_{n:08d}.pt"]
    # a new process: other RNG states, a model initialised differently, a new data source
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    model = make(7)
    second = train(model, _resume_data(), steps=2 * n, checkpoint_dir=tmp_path, resume=True, **kw)

    assert second.start_step == n and [r["step"] for r in second.records] == list(range(n + 1, 2 * n + 1))
    assert first.losses + second.losses == straight.losses      # == on floats: bit for bit
    for k, v in model.state_dict().items():
        assert torch.equal(v, straight_params[k]), k
    assert torch.equal(torch.get_rng_state(), straight_rng[0]) and random.getstate() == straight_rng[1]
    assert np.array_equal(np.random.get_state()[1], straight_rng[2])
    if precision == "fp16":
        assert all(r["scale"] is not None for r in second.records)
    assert len(set(straight.losses)) > 1 and straight.losses[-1] < straight.losses[0]


def test_resume_from_an_iterable_without_state(tmp_path):
    """A plain deterministic iterable: skipped ahead to the saved position."""
    data = [batch(B=1, S=12, pad=i % 3, seed=i) for i in range(7)]

    def gen():
        yield from data

    class Replay:
        def __iter__(self):
            return gen()

    kw = dict(lr=1e-2, progress=False, schedule="linear", total_steps=6)
    straight = train(hf_family("llama", num_layers=1), Replay(), steps=6, **kw)
    first = train(hf_family("llama", num_layers=1), Replay(), steps=3, checkpoint_dir=tmp_path, **kw)
    second = train(hf_family("llama", num_layers=1, seed=5), Replay(), steps=6, checkpoint_dir=tmp_path,
                   resume=True, **kw)
    assert first.losses + second.losses == straight.losses


# ---- logs --------------------------------------------------------------------------------------

def test_jsonl_log_logger_and_progress_bar(tmp_path, caplog, capsys):
    data = [batch(B=2, S=16, pad=3, seed=i) for i in range(4)]
    log = tmp_path / "logs" / "train.jsonl"
    caplog.set_level(logging.DEBUG, logger="tailorfx")
    result = train(hf_family("llama", num_layers=1), data, steps=4, grad_accum=2, log_path=log, progress=False,
                   checkpoint_dir=tmp_path / "ckpt", save_every=2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and lines == json.loads(json.dumps(result.records))
    for r in lines:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "time"} <= r.keys()
        assert r["tokens"] == 2 * 2 * 16 and r["targets"] == 2 * 2 * 12
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["time"] > 0
    assert [r["loss"] for r in lines] == result.losses
    assert lines[0]["lr"] == 3e-4 and lines[-1]["lr"] < lines[0]["lr"]      # cosine decay
    msgs = [r.getMessage() for r in caplog.records if r.name == "tailorfx"]
    assert any(m.startswith("step 4: loss") for m in msgs) and any("saved checkpoint" in m for m in msgs)
    assert any(m.startswith("trained steps 1..4") for m in msgs)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""             # progress=False: no bar, and nothing printed

    # resume after a crash at step 3: the log's lines past the checkpoint (step 2) are replaced
    (tmp_path / "ckpt" / "step_00000004.pt").unlink()
    again = train(hf_family("llama", num_layers=1), data, steps=4, grad_accum=2, log_path=log, progress=True,
                  checkpoint_dir=tmp_path / "ckpt", resume=True, total_steps=4)
    lines2 = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines2] == [1, 2, 3, 4] and lines2[:2] == lines[:2]
    assert again.losses == result.losses[2:]
    err = capsys.readouterr().err
    assert "train" in err and "4/4" in err              # the tqdm bar, on stderr


def test_trains_a_tailorfx_optimized_module_on_packed_batches():
    """train() drives an OptimizedModule as it drives the model: same losses and weights."""
    import copy

    import tailorfx
    data = PackedBatches(_docs([3 + (7 * i) % 29 for i in range(12)], seed=2), seq_len=32, batch_size=2)
    base = hf_family("llama", num_layers=1)
    eager, rewritten = copy.deepcopy(base), copy.deepcopy(base)
    want = train(eager, data, steps=2, grad_accum=2, lr=1e-3, progress=False)
    example = {k: v for k, v in data[0].items() if k != "document_ids"}
    opt = tailorfx.optimize(rewritten, example_inputs=example)
    got = train(opt, data, steps=2, grad_accum=2, lr=1e-3, progress=False)
    assert got.losses == pytest.approx(want.losses, rel=1e-5)
    for (name, p), q in zip(rewritten.named_parameters(), eager.parameters()):
        # the rewrites round differently, and AdamW turns a gradient within rounding of 0 into a
        # step of a fraction of lr either way: atol lr/100
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("precision", [None, "fp16"])
def test_a_step_without_labels_updates_nothing(precision):
    data = [batch(B=1, S=12, seed=0), batch(B=1, S=12, pad=12, seed=1)]       # the second: all -100
    model = hf_family("llama", num_layers=1)
    r = train(model, data[:1], steps=1, precision=precision, progress=False)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    r2 = train(model, data[1:], steps=1, precision=precision, progress=False, seed=None)
    assert r2.skipped == 1 and r2.records[0]["targets"] == 0 and r2.records[0]["skipped"]
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    assert r.skipped == 0 and r.records[0]["loss"] > 0
