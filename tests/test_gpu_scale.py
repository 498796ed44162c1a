"""benchmarks/gpu_scale.py: its dry run (every section of the 8B scale run, on a 2-layer Llama on CPU,
so the script a lent GPU runs first does not rot between loans; a few minutes: `make test-slow`),
and the parts only a GPU run would otherwise exercise: the time guard, the watchdog, the gradient
comparison by name, ALST's one update a step."""
import json
import os
import shlex
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import bench_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCH_DIR, "gpu_scale.py")


@pytest.fixture(scope="module")
def gpu_scale():
    """The script as a module (its folder off sys.path again)."""
    return bench_script.load("gpu_scale")


@pytest.fixture(scope="module")
def gpucheck(gpu_scale):
    """The gpucheck modules the script imported, from sys.modules (their folder is off sys.path again)."""
    return types.SimpleNamespace(**{name: sys.modules[f"gpucheck.{name}"] for name in ("record", "guard", "steps")})


def cpu_run(gpu_scale, tmp_path, budget_s: float, dry: bool = False):
    args = types.SimpleNamespace(dry_run=dry, budget_s=budget_s, out=str(tmp_path / "out.json"), section=None)
    return gpu_scale.Run(args, "cpu", sections=gpu_scale.SECTIONS)


def test_a_check_that_does_not_fit_the_time_left_is_skipped(gpu_scale, gpucheck, tmp_path):
    run = cpu_run(gpu_scale, tmp_path, budget_s=60)
    sec = run.data["sections"]["speed"] = gpucheck.record.new_section()
    skipped = gpucheck.guard.guarded(run, sec, "long", 600, lambda: pytest.fail("started without the time"))
    ran = gpucheck.guard.guarded(run, sec, "short", 1, lambda: {"x": 1})
    assert skipped["status"] == "skipped" and "600 s needed" in skipped["reason"]
    assert ran["status"] == "pass" and ran["estimate_s"] == 1 and ran["at_s"] >= 0 and ran["started"]
    assert [c["name"] for c in json.loads((tmp_path / "out.json").read_text())["sections"]["speed"]["checks"]] == \
        ["long", "short"]


def test_estimates_count_planning_and_the_first_step(gpu_scale, gpucheck, tmp_path):
    guard, steps = gpucheck.guard, gpucheck.steps
    run = cpu_run(gpu_scale, tmp_path, budget_s=60, dry=True)
    assert steps.config_params(gpu_scale.config(True)) == steps.counted_params(gpu_scale.build(run))
    cfg = gpu_scale.config(False)   # the 8B config
    steps_only = guard.estimate_s(run, cfg, 32768, steps=5)
    planned = guard.estimate_s(run, cfg, 32768, steps=5, plan=True)
    assert planned - steps_only > guard.PLAN_S
    assert steps_only > guard.BUILD_S + guard.FIRST_STEP_S + 5 * 5   # a 32K step takes seconds
    run.shared["plan_s"] = 10.0   # measured by the run's first budgeted optimize()
    assert guard.estimate_s(run, cfg, 32768, steps=5, plan=True) < planned


def test_a_call_runs_the_sections_rows_and_lengths_asked_in_the_order_asked(gpu_scale, gpucheck, tmp_path, monkeypatch):
    """A GPU lease allows one call of a few minutes: --section runs in the order given, --provider
    and --length narrow the speed section to the rows that call is for."""
    args = types.SimpleNamespace(dry_run=False, budget_s=600, out=str(tmp_path / "out.json"),
                                 section=["speed", "longest", "speed"], provider=["liger+hf-checkpointing", "tailorfx"],
                                 length=[16384])
    run = gpu_scale.Run(args, "cpu", sections=gpu_scale.SECTIONS)
    assert run.sections == ["speed", "longest"]
    names = []
    agreed = []

    def guarded(run, sec, name, need, fn):   # the rows' names; an agreement's length
        names.append(name)
        if name.startswith("agreement"):
            fn()
    monkeypatch.setattr(gpu_scale, "guarded", guarded)
    monkeypatch.setattr(gpu_scale, "agreement", lambda run, name, S: agreed.append(S))
    gpu_scale.section_speed(run, gpucheck.record.new_section())
    assert names == ["liger+hf-checkpointing S=16384", "tailorfx S=16384",   # TOP_ROW's order
                     "agreement tailorfx", "agreement liger+hf-checkpointing"]
    assert agreed == [512, 512]   # the agreements' length is the default's, whatever --length asks
    args.provider, args.length = None, None   # the default: every row, the longest length first
    names.clear()
    gpu_scale.section_speed(run, gpucheck.record.new_section())
    assert names[:6] == ["tailorfx, lowering auto S=32768", "liger+hf-checkpointing S=32768",
                         "tailorfx, lowering auto, activations offloaded S=32768", "tailorfx S=32768",
                         "tailorfx, offloaded, Triton kernels S=32768", "tailorfx, Triton kernels S=32768"]
    assert len(names) == 10 + 4 + 2 * 5 and names[-1] == "alst S=8192"


def test_the_next_runs_first_call_starts_the_default_plans_row_and_learns_the_planning_time(gpu_scale, gpucheck,
                                                                                            tmp_path, monkeypatch):
    """docs/gpu.md's first scale command, each row taking all of its estimate: the row of optimize()'s
    default plan (Inductor on CUDA), the one the MFU goal is for, starts (in the order before
    2026-12-06 the rows ahead of it left it too little time). A plain tailorfx row's optimize()
    time then stands for the later rows' planning."""
    words = next(c for c in next_gpu_run_commands() if c[0] == "benchmarks/gpu_scale.py")
    flag = lambda name: [words[i + 1] for i, w in enumerate(words) if w == name]
    args = types.SimpleNamespace(dry_run=False, budget_s=float(flag("--budget-s")[0]), out=str(tmp_path / "o.json"),
                                 section=flag("--section"), provider=flag("--provider"),
                                 length=[int(x) for x in flag("--length")])
    run = gpu_scale.Run(args, "cpu", sections=gpu_scale.SECTIONS)
    clock = {"left": args.budget_s - 30.0}   # the wheels' install, the imports, the weight-gradient check
    started = []

    def guarded(run, sec, name, need, fn):
        if need <= clock["left"]:
            started.append(name)
            clock["left"] -= need
    monkeypatch.setattr(gpu_scale, "guarded", guarded)
    gpu_scale.section_speed(run, gpucheck.record.new_section())
    assert started[0] == f"{gpu_scale.INDUCTOR} S=32768", started
    assert "liger+hf-checkpointing S=32768" in started   # the best peer measured, beside it

    monkeypatch.setattr(gpu_scale, "build", lambda run: None)
    monkeypatch.setattr(gpu_scale, "batch", lambda run, S: {})
    monkeypatch.setattr(gpu_scale, "make_provider", lambda *a: gpu_scale.Provider(None, dict))

    def oom(*a):
        raise torch.OutOfMemoryError("the steps are not this test's")
    monkeypatch.setattr(gpu_scale, "stepper", oom)
    run.shared.pop("plan_s", None)
    assert "oom" in gpu_scale.timed_steps(run, gpu_scale.INDUCTOR, 32768, reps=1)
    assert "plan_s" not in run.shared   # its set-up holds the Inductor trace too
    res = gpu_scale.timed_steps(run, "tailorfx", 32768, reps=1)
    assert run.shared["plan_s"] == res["setup_s"]


def test_a_gpu_profile_splits_kernels_from_the_ops_that_launched_them(gpucheck):
    """On a GPU the profile holds both the device's kernels and the host's ops (each with the time of
    the kernels it launched itself): kind sums take the kernels alone, `by_op` the ops alone."""
    from torch.autograd import DeviceType
    ev = lambda key, dev, us: types.SimpleNamespace(key=key, device_type=dev, self_device_time_total=us,
                                                    self_cpu_time_total=5, count=2)
    events = [ev("nvjet_sm90_tst_256x128", DeviceType.CUDA, 3e6), ev("aten::mm", DeviceType.CPU, 3e6),
              ev("elementwise_kernel<BinaryFunctor<BFloat16>>", DeviceType.CUDA, 1e6),
              ev("aten::mul", DeviceType.CPU, 1e6), ev("aten::matmul", DeviceType.CPU, 0),
              ev("autograd::engine::evaluate_function: MmBackward0", DeviceType.CPU, 0)]
    kernels, ops = gpucheck.steps.profile_rows(events, cuda=True)
    assert kernels == [("nvjet_sm90_tst_256x128", 3.0, 2), ("elementwise_kernel<BinaryFunctor<BFloat16>>", 1.0, 2)]
    assert ops == [("aten::mm", 3.0, 2), ("aten::mul", 1.0, 2)]
    on_cpu, same = gpucheck.steps.profile_rows(events, cuda=False)   # ATen's ops by their own time
    assert on_cpu is same and [r[0] for r in on_cpu] == ["aten::mm", "aten::mul", "aten::matmul"]


def test_the_watchdog_writes_the_json_and_ends_the_process(tmp_path):
    out = tmp_path / "out.json"
    code = textwrap.dedent(f"""
        import sys, time, types
        sys.path.insert(0, {BENCH_DIR!r})
        from gpucheck.guard import start_watchdog
        from gpucheck.record import Run, new_section
        args = types.SimpleNamespace(dry_run=True, budget_s=0.5, out={str(out)!r}, section=None)
        run = Run(args, "cpu", sections=("longest",))
        sec = run.data["sections"]["longest"] = new_section()
        start_watchdog(run, 0.5)
        run.check(sec, "hangs", lambda: time.sleep(60))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    data = json.loads(out.read_text())
    check = data["sections"]["longest"]["checks"][0]
    assert check["name"] == "hangs" and check["status"] == "timeout" and check["seconds"] >= 0.5
    assert data["sections"]["longest"]["status"] == "timeout" and "stopped at" in data["meta"]["watchdog"]


def tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_gradients_are_compared_under_the_unwrapped_names(gpu_scale, gpucheck):
    from collections import Counter
    alst = gpu_scale.bench_module("alst")
    model = tiny_llama()
    eager_names = [n for n, _ in model.named_parameters()]
    names = {id(p): n for n, p in model.named_parameters()}
    for layer in model.model.layers:   # what ALSTCausalLM does: the names become ...mlp.mlp.*
        layer.mlp = alst.TiledMLPBlock(layer.mlp, Counter())
    assert any(".mlp.mlp." in n for n, _ in model.named_parameters())
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, float(i + 1))
    steps = gpucheck.steps
    got = steps.grad_norms(model, names)
    assert sorted(got) == sorted(eager_names)
    assert steps.worst_grad_rel(got, dict(got)) == 0.0
    with pytest.raises(ValueError, match="eager only"):   # a missing name fails, it does not compare 0
        steps.worst_grad_rel(got, {n: g for n, g in got.items() if ".mlp." not in n})
    with pytest.raises(ValueError, match="provider made it"):
        steps.grad_norms(model, {})


def test_alst_optimizer_updates_once_after_the_last_shard(gpu_scale):
    """DeepSpeed's tiled functions run autograd.backward once per shard, with ds_grad_is_ready False
    on the parameters for all shards but the last; the update must come once, from the sum."""
    import tailorfx
    alst = gpu_scale.bench_module("alst")

    def sharded_step(optimizer_class):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
        x = torch.randn(3, 4, 8, dtype=torch.bfloat16)
        opt = optimizer_class(lin.parameters(), gpu_scale.SETUP)
        try:
            for i, shard in enumerate(x):
                lin.weight.ds_grad_is_ready = i == len(x) - 1
                lin(shard).float().pow(2).sum().backward()
            return opt.num_updates, lin.weight.detach().clone()
        finally:
            opt.close()

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 4, 8, dtype=torch.bfloat16)
    opt = tailorfx.SetupOptimizer(lin.parameters(), gpu_scale.SETUP)
    try:
        lin(x.reshape(12, 8)).float().pow(2).sum().backward()   # one backward of every shard
    finally:
        opt.close()
    updates, weight = sharded_step(alst.LastShardOptimizer)
    assert updates == 1 and torch.allclose(weight.float(), lin.weight.float(), atol=1e-2)
    assert sharded_step(tailorfx.SetupOptimizer)[0] == 3   # the plain hooks step once a shard


def failed_checks(sec: dict) -> list:
    """(name, error) of each check of a section of the JSON that neither passed nor was skipped."""
    return [(c["name"], c.get("error", c)) for c in sec["checks"] if c["status"] not in ("pass", "skipped")]


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path):
    out = tmp_path / "gpu_scale.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["meta"]["lowering"] == "eager"
    assert data["meta"]["weight_grad_sum"]["rel_err"] < 1e-6   # bf16 products summed in fp32
    assert list(data["sections"]) == ["longest", "speed", "offload", "probe"]
    for name, sec in data["sections"].items():
        bad = failed_checks(sec)
        assert sec["status"] == "ok" and not bad, (name, bad)
        # only a peer that is not installed here is skipped, and it says how to carry it; and the
        # Triton rows, which Triton's interpreter would take minutes a step over
        assert all("not installed" in c["reason"] or "needs DeepSpeed" in c["reason"]
                   or c["name"].startswith(("tailorfx, Triton kernels", "tailorfx, offloaded, Triton kernels"))
                   and "interpreter" in c["reason"]
                   for c in sec["checks"] if c["status"] == "skipped"), name
        assert all("started" in c and "estimate_s" in c for c in sec["checks"] if c["status"] == "pass"), name
    longest = {c["name"]: c for c in data["sections"]["longest"]["checks"]}
    S = longest["max_seq_len"]["predicted_longest"]
    assert longest["train at the longest length"]["tokens"] == S
    assert "cannot be met" in longest["next granule refused"]["refused"]
    speed = {c["name"]: c for c in data["sections"]["speed"]["checks"]}
    for S in (256, 512):
        assert speed[f"tailorfx S={S}"]["fired"]["logits_skipped"]          # the fused head ran
        assert "predicted" in speed[f"tailorfx S={S}"]["prediction"]
        # what the prediction counted: the weights and AdamW state among them (6 bytes a parameter)
        parts = speed[f"tailorfx S={S}"]["prediction"]["parts"]
        assert 0 < parts["params"] < parts["optimizer_state"]   # two bf16 moments a bf16 weight
        for name in ("tailorfx", "eager", "hf-checkpointing"):   # one step profiled: the matmuls and attention seen
            prof = speed[f"{name} S={S}"]["profile"]
            assert prof["by_kind_s"]["gemm"] > 0 and prof["by_kind_s"]["attention"] > 0, (name, prof)
            assert 0 < prof["kernel_s"] and prof["top"] and prof["by_op"], (name, prof)
        assert speed[f"hf-checkpointing S={S}"]["fired"]["checkpointing"]
        # the same model: checkpointing holds less than eager
        assert (speed[f"hf-checkpointing S={S}"]["measured"]["dynamic_peak"]
                < speed[f"eager S={S}"]["measured"]["dynamic_peak"])
    offloaded = speed["tailorfx, activations offloaded S=512"]
    assert offloaded["status"] == "pass" and offloaded["fired"]["plan"] and offloaded["mfu"] > 0
    assert "tailorfx, activations offloaded S=256" not in speed   # the longest row only
    auto = speed["tailorfx, lowering auto S=512"]   # on the CPU "auto" is the eager lowering, as LOWERING
    assert auto["status"] == "pass" and auto["fired"]["lowerings"] == speed["tailorfx S=512"]["fired"]["lowerings"]
    assert "eager" in auto["fired"]["lowerings"] and "tailorfx, lowering auto S=256" not in speed
    for name in ("tailorfx", "hf-checkpointing"):
        agree = speed[f"agreement {name}"]
        assert agree["status"] == "pass" and agree["updates_in_one_step"] == agree["parameters"] > 0
    offload = {c["name"]: c for c in data["sections"]["offload"]["checks"]}
    assert offload["offloaded at its longest"]["host_bytes_predicted"] > 0
    probe = data["sections"]["probe"]["checks"][0]
    assert probe["returncode"] == 0 and probe["tokens"] == longest["max_seq_len"]["predicted_longest"] + 64
    assert probe["status"] == "pass" and "error" not in probe and "over_limit" in probe


def next_gpu_run_commands() -> list[list[str]]:
    """The benchmark commands docs/gpu.md's "The next GPU run" gives a lent GPU, as argument lists
    after `python3` ($OUT left in)."""
    text = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    section = text.split("\n## The next GPU run\n", 1)[1].split("\n## ", 1)[0]
    commands, pending = [], ""
    for line in section.splitlines():
        if not line.startswith("    "):
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        words = shlex.split(pending)
        pending = ""
        while words and "=" in words[0]:   # PYTHONUNBUFFERED=1
            words.pop(0)
        if words[:1] == ["python3"] and words[1:2] and words[1].startswith("benchmarks/"):
            commands.append(words[1:])
    return commands


def triton_interpreter_runs(tmp_path, env: dict) -> bool:
    """Whether Triton's interpreter runs tailorfx's RMSNorm, forward and backward, here: under torch
    2.11 (make test-torch211) its Triton 3.6 fails on numpy 2.4 in the backward ("only 0-dimensional
    arrays can be converted to Python scalars"); only the GPU runs the kernels with that Triton."""
    script = tmp_path / "interpreted.py"
    script.write_text(textwrap.dedent("""
        import torch
        from tailorfx.runtime import triton_ops
        x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
        triton_ops.triton_norm(x, torch.ones(64, dtype=torch.bfloat16), None, eps=1e-6, kind="rms").sum().backward()
    """))
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=300).returncode == 0


@pytest.mark.slow
@pytest.mark.gpu_release
def test_the_next_gpu_runs_commands_rehearse_on_the_cpu(tmp_path):
    """Each benchmark command docs/gpu.md gives the next lease, its flags as written, under --dry-run:
    every section it asks for runs at least one check and none fails (the speed rows at --length
    32768 scaled to the dry run's lengths; a second call's probe predicts its own length: before,
    the first errored on the CPU budget and the probe ran nothing, reported ok)."""
    commands = next_gpu_run_commands()
    scale = [c for c in commands if c[0] == "benchmarks/gpu_scale.py"]
    kernels = [c for c in commands if c[0] == "benchmarks/kernel_speed.py"]
    assert len(scale) >= 2 and len(kernels) == 1, commands
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    interpreted = triton_interpreter_runs(tmp_path, env)
    for i, words in enumerate(commands):
        out = tmp_path / f"call{i}"
        out.mkdir()
        args = [w.replace("$OUT", str(out)) for w in words] + ["--dry-run"]
        if words in kernels:   # every case's dry run: tests/test_kernels_benchmark.py
            args += ["--only", "rms_norm"]
        r = subprocess.run([sys.executable, os.path.join(ROOT, *args[0].split("/")), *args[1:]],
                           env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert r.returncode == 0, (words, r.stderr[-4000:])
        written = [json.loads(p.read_text()) for p in out.glob("*.json")]
        assert len(written) == 1, (words, list(out.iterdir()))
        if words in kernels:
            rows = written[0]["rows"]
            errors = [row for row in rows if "error" in row]
            if not interpreted:   # its rows ran up to the kernel; the kernels' exactness: make test
                errors = [row for row in errors if not row["error"].startswith("InterpreterError")]
            assert rows and not errors, rows
            continue
        asked = [words[j + 1] for j, w in enumerate(words) if w == "--section"]
        sections = written[0]["sections"]
        assert asked and list(sections) == asked, (words, list(sections))
        for name, sec in sections.items():
            bad = failed_checks(sec)
            assert sec["status"] == "ok" and not bad, (words, name, bad)
            assert any(c["status"] == "pass" for c in sec["checks"]), (words, name, sec)
