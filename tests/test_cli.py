"""The command line: every subcommand on a tiny transformers config, and every kind of bad argument
(one line on stderr, exit code 2). `plan --world` is tested with the parallel memory model
(tests/test_parallel_memory.py), `demo` by tests/test_demo.py."""
import json

import pytest

from tailorfx.budget import Budget
from tailorfx.cli import main

TINY = ["llama", "vocab_size=512", "hidden_size=64", "intermediate_size=128", "num_hidden_layers=2",
        "num_attention_heads=4", "num_key_value_heads=2"]


def test_inspect_a_config_on_fake_tensors(capsys):
    main(["inspect", *TINY, "--seq", "256", "--passes", "attention", "minisequence"])
    out = capsys.readouterr().out
    assert "llama (hidden_size 64, num_hidden_layers 2" in out and "passes ['attention', 'minisequence']" in out
    for region in ("model.layers.0.self_attn", "model.layers.1.mlp", "lm_head"):
        assert region in out
    assert "logits=None" in out   # the fused head fired


@pytest.mark.slow
def test_plan_names_the_passes_and_the_longest_sequence(monkeypatch, capsys):
    monkeypatch.setenv("TAILORFX_PROGRESS", "1")   # the bars, also when stderr is not a terminal
    main(["plan", *TINY, "--budget", "16MiB", "--seq", "1024", "--setup", "fp32"])
    out, err = capsys.readouterr()
    # long calls show each stage on stderr; the longest sequence is found in a second process
    # (its own bars off), waited for under a bar of this one
    for bar in ("capturing and planning the step on fake tensors", "graph 0: finding regions", "planning",
                "graph 0: lowering", "longest sequence that fits (the second process)"):
        assert f"tailorfx: {bar}" in err, err
    chosen = [l for l in out.splitlines() if l.startswith("* ")]
    assert len(chosen) == 1 and chosen[0].rstrip().endswith("yes"), out
    no_rewrite = next(l for l in out.splitlines() if "no memory rewrite" in l)
    assert no_rewrite.rstrip().endswith("no") and "chosen: passes ['attention', 'minisequence'" in out
    longest = int(out.split("longest sequence under 16MiB (16.00 MiB): ")[1].split(" tokens")[0].replace(",", ""))
    assert longest >= 1024   # the plan chosen at 1024 fits, so 1024 tokens fit
    bound = int(out.split("the device-only limit: no device-only plan of these rewrites fits more than ")[1]
                .split(" tokens")[0].replace(",", ""))
    assert longest <= bound, out   # a bound: no plan, the best included, fits more


def test_plan_after_a_backward_in_the_process_finds_the_longest_sequence(capsys):
    """`plan` called in a process that ran a backward before (a notebook, a training script): on torch
    2.11's CUDA build autograd refuses to run in a forked child ("fork-based multiprocessing"), and the
    longest sequence is then found in this process (before: the error; `make test-torch211` runs this)."""
    import tailorfx
    from models import batch, hf_family
    tailorfx.optimize(hf_family("llama", num_layers=1), passes=["minisequence"])(**batch(S=16)).loss.backward()
    main(["plan", *TINY, "--budget", "16MiB", "--seq", "256", "--setup", "fp32"])
    out = capsys.readouterr().out
    longest = int(out.split("longest sequence under 16MiB (16.00 MiB): ")[1].split(" tokens")[0].replace(",", ""))
    assert longest >= 256, out   # the plan chosen at 256 fits


def test_plans_second_process_runs_parallel_ops_after_the_first_started_openmps_threads(monkeypatch):
    """`plan` forks its longest-sequence search; a parent that had run a parallel op (here a
    2048 x 2048 tril on every thread) left GNU OpenMP's team unusable in the child, whose first
    parallel op then hung (the Gemma-2-9B plan under pytest). The child runs one thread."""
    import multiprocessing

    import torch

    from tailorfx import cli, sizing
    torch.tril(torch.ones(2048, 2048)).sum()
    monkeypatch.setattr(sizing, "max_seq_len", lambda *a, **k: int(torch.tril(torch.ones(2048, 2048)).sum()))
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(cli._longest, (None, None, 1, None)).get(timeout=60)
    assert got == 2048 * 2049 // 2


def test_plan_a_budget_no_plan_meets_exits_1_and_says_what_fits(capsys):
    # weights + AdamW state alone (fp32: 16 B/param, 1.6 MiB) overflow 1 MiB: said before any capture
    with pytest.raises(SystemExit) as e:
        main(["plan", *TINY, "--budget", "1MiB", "--seq", "1024", "--setup", "fp32"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "the static part alone does not fit 1MiB" in err and "Setups whose static part fits: pure-bf16" in err


@pytest.mark.slow
def test_train_logs_checkpoints_and_resumes(tmp_path, capsys):
    data = tmp_path / "text"
    data.mkdir()
    for i in range(12):
        (data / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(150)))
    args = ["train", *TINY, "--data", str(data), "--seq", "32", "--batch", "2", "--out", str(tmp_path / "out"),
            "--save-every", "3", "--passes", "minisequence"]
    main([*args, "--steps", "3"])
    out = capsys.readouterr().out
    assert "steps 1-3: loss" in out and "checkpoint" in out
    main([*args, "--steps", "5", "--resume"])
    out = capsys.readouterr().out
    assert "steps 4-5: loss" in out
    log = [json.loads(l) for l in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r][-5:] == [1, 2, 3, 4, 5]


@pytest.mark.ptxas   # make test-torch211 (CI) runs it under the GPU machines' Triton
def test_kernels_compile_for_sm80_at_the_configs_shapes(capsys):
    """Each kernel compiled as a GPU launch starts it: attention's three kernels each at its
    role's first tile candidate for the arch (its warps, bf16 dots), with its own grid."""
    from tailorfx.kernels import flash_tiles
    main(["kernels", *TINY, "--seq", "128", "--arch", "80"])
    lines = capsys.readouterr().out.splitlines()
    rows = {l.split()[0].split("_")[0]: l.split() for l in lines[2:]}
    assert {"norm", "flash", "glu", "linear"} <= set(rows), lines
    for line in lines[2:]:
        row = line.split()
        assert int(row[1]) > 0 and int(row[2]) == 0, row   # registers, no spills
    norm = rows["norm"]
    assert norm[-1] == "(128,)"   # one program per token row
    flash = {l.split()[0].split(":")[1]: l.split() for l in lines[2:] if l.startswith("flash")}
    assert set(flash) == {f"{r}/{flash_tiles.candidates(r, 'bf16', 16, 'full', 80)[0].num_warps}w"
                          for r in flash_tiles.ROLES}, lines
    for role, row in flash.items():
        first = flash_tiles.candidates(role.split("/")[0], "bf16", 16, "full", 80)[0]
        rows_held = first.block_n if role.startswith("dkdv") else first.block_m
        # (tiles of 128 tokens, batch x heads = 4; batch x kv heads = 2 for dk/dv)
        assert row[-2:] == [f"({-(-128 // rows_held)},", "2)" if role.startswith("dkdv") else "4)"], row


@pytest.mark.parametrize("argv,message", [
    (["inspect", "lama"], "unknown model type 'lama': did you mean llama"),
    (["inspect", "llama", "hiden_size=64"], "no field 'hiden_size'; did you mean hidden_size"),
    (["inspect", "llama", "hidden_size"], "is not KEY=VALUE"),
    (["inspect", "no/such/config.json"], "no config file"),
    (["inspect", "--seq", "0"], "argument --seq: must be a positive integer, got '0'"),
    (["inspect", "--passes", "minisequance"], "unknown pass 'minisequance'"),
    (["plan", *TINY], "plan needs --budget SIZE"),
    (["plan", *TINY, "--budget", "lots"], "cannot parse budget"),
    (["plan", *TINY, "--budget", "1GB", "--setup", "fp8"], "fp8"),
    (["train", *TINY, "--data", "/no/such/folder"], "--data '/no/such/folder': no such file or folder"),
    (["train", *TINY, "--lr", "-1"], "argument --lr: must be a positive number, got '-1'"),
    (["kernels", *TINY, "--arch", "70"], "argument --arch: invalid choice: 70"),
    (["bench", "nosuch"], "no benchmark 'nosuch'; available:"),
    (["nosuch"], "invalid choice: 'nosuch'"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_demo_and_bench_are_reached_through_the_cli(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])                 # the demo's own options
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernel_speed"])          # benchmarks/kernel_speed.py: needs a GPU, says so
    assert e.value.code == 1



@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_plan_for_a_cuda_preset_says_its_prediction_is_modelled_for_cuda(capsys):
    main(["plan", *TINY, "--budget", "H100-80GB", "--seq", "2048", "--setup", "pure-bf16"])
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("predictions modelled for CUDA (sm90)"))
    for formula in ("cublas_workspace 64.00 MiB", "flash_backward_scratch", "allocator_headroom 5%"):
        assert formula in line, line
    # on a GPU the planner may offload checkpoints: each bound is named, the device-only one beside the
    # device-only longest sequence, and the one with host offload fits more
    longest = int(out.split("tokens at batch 1, device-only")[0].split(": ")[-1].replace(",", ""))
    device = int(out.split("the device-only limit: no device-only plan of these rewrites fits more than ")[1]
                 .split(" tokens")[0].replace(",", ""))
    host = int(out.split("the host-offload limit: no host-offload plan of these rewrites fits more than ")[1]
               .split(" tokens")[0].replace(",", ""))
    assert longest <= device <= host, out
    floor = {kind: Budget.parse(out.split(f"tokens no {kind} plan peaks below ")[1].split(" (")[0]).bytes
             for kind in ("device-only", "host-offload")}
    assert floor["host-offload"] < floor["device-only"], floor
