PY ?= python3
VENV := .venv
VENV211 := .venv-torch211
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow test-torch211 test-long demo bench-deps gpu-wheels clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first, from the pinned CPU wheel; everything else after it
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# two workers for the two cores (tests/conftest.py gives each one intra-op thread). `make test`
# runs the suite in one virtualenv (the CPU wheel) but for the tests marked slow or multiprocess
# (`make test-slow`) and those marked cuda_build (`make test-torch211`); CI runs all three
PYTEST := -m pytest -q -n 2 --dist worksteal --durations=30
test: $(STAMP)
	$(BIN)/python $(PYTEST) -m "not slow and not multiprocess and not cuda_build" tests

test-slow: $(STAMP)
	$(BIN)/python $(PYTEST) -m "(slow or multiprocess) and not cuda_build and not ptxas and not long" tests

# torch 2.11 (the GPU machines' release, its CUDA build, which runs on CPU) in a second virtualenv:
# the package installed over it must keep that torch; CI runs on it, after `make test`, a smoke
# subset of the suite (its files' tests of `make test`: the slow ones run once, in `make test-slow`)
# and the tests marked cuda_build (tests/test_fake_cuda.py: captures on fake
# CUDA tensors, which a CPU wheel of torch cannot index)
SMOKE211 := tests/test_api.py tests/test_minisequence.py tests/test_recompute.py \
	tests/test_attention_packed.py tests/test_fake_cuda.py tests/test_inductor_region.py tests/test_precision.py \
	tests/test_attention_pass.py::test_exact_matches_eager tests/test_trace_cache.py \
	tests/test_cli.py::test_plan_after_a_backward_in_the_process_finds_the_longest_sequence \
	tests/test_parallel.py::test_zero_bubble_is_refused_where_torchs_pipelining_loses_a_custom_ops_backward \
	tests/test_passes.py::test_optimized_modules_leave_no_regions_behind \
	tests/test_parallel_memory.py::test_a_tp_rank_of_a_model_without_a_kv_cache_is_predicted_as_it_runs \
	tests/test_parallel_memory.py::test_a_tp_rank_whose_logits_get_no_gradient_is_predicted_as_it_runs
# and every kernel compiled with ptxas under its Triton (3.6: the GPU machines'), which allocates
# registers otherwise than 3.9 does (its interpreter fails on numpy 2.4: kernels do not run here);
# those marked ptxas run here only (make test-slow leaves them: minutes of ptxas a second time)
COMPILE211 := tests/test_triton_codegen.py::test_every_example_compiles_for_sm80_and_sm90 \
	tests/test_triton_codegen.py::test_every_attention_tile_candidate_compiles_without_spills \
	tests/test_triton_attention.py::test_compiles_for_sm90_without_spills \
	tests/test_triton_kernels.py::test_compiles_for_sm90 \
	tests/test_triton_kernels.py::test_every_rope_layout_compiles_without_spills \
	tests/test_cli.py::test_kernels_compile_for_sm80_at_the_configs_shapes
# and the next GPU run's commands as docs/gpu.md gives them, under --dry-run with the machines' torch
REHEARSE211 := tests/test_gpu_scale.py::test_the_next_gpu_runs_commands_rehearse_on_the_cpu
$(VENV211)/.installed: pyproject.toml
	$(PY) -m venv $(VENV211)
	$(VENV211)/bin/pip install --upgrade pip
	$(VENV211)/bin/pip install torch==2.11.0
	$(VENV211)/bin/pip install -e '.[dev]'
	$(VENV211)/bin/python -c "import torch; v = torch.__version__; assert v.startswith('2.11.'), f'pip replaced torch 2.11 with {v}'"
	touch $@

test-torch211: $(VENV211)/.installed
	$(VENV211)/bin/python $(PYTEST) -m "ptxas or cuda_build or gpu_release or not (slow or multiprocess or long)" \
		$(SMOKE211) $(COMPILE211) $(REHEARSE211)

# not in CI: the property test's long profile (200 random models; CI runs its short profile in
# `make test`) and the tests marked long, each the costly form of a claim a test in CI checks
# (tests/suite_time.py LONG names it)
test-long: $(STAMP)
	TAILORFX_PROPERTY_EXAMPLES=200 $(BIN)/python -m pytest -q -n 2 --dist worksteal tests/test_property.py
	$(BIN)/python $(PYTEST) -m "long" tests

demo: $(STAMP)
	$(BIN)/python -m tailorfx.cli demo

# the benchmarks' optional peers (the `alst` extra): DeepSpeed with none of its ops built, built
# against the venv's torch (no build isolation, so pip never fetches another torch)
bench-deps: $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/pip install --no-build-isolation deepspeed==0.19.8

# the peers of benchmarks/gpu_scale.py as wheels for the GPU machine (no network there; Python 3.12,
# x86-64): Liger-Kernel, DeepSpeed built here with none of its ops, and DeepSpeed's own
# requirements; the device call carries .gpu-wheels and installs them with --no-index (docs/gpu.md)
GPU_WHEELS := .gpu-wheels
gpu-wheels: $(STAMP)
	mkdir -p $(GPU_WHEELS)
	$(BIN)/pip download --no-deps -d $(GPU_WHEELS) liger-kernel==0.8.5
	DS_BUILD_OPS=0 $(BIN)/pip wheel --no-deps --no-build-isolation -w $(GPU_WHEELS) deepspeed==0.19.8
	$(BIN)/pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 -d $(GPU_WHEELS) einops hjson msgpack ninja psutil py-cpuinfo pydantic

clean:
	rm -rf $(VENV) $(VENV211) .pytest_cache
