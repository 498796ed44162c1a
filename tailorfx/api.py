"""optimize(): capture -> plan -> passes -> codegen -> OptimizedModule."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from tailorfx.backend import GraphRecord, Session, StepObservation
from tailorfx.options import Options, batch_of, check_flag, check_passes, pass_options, split_examples
from tailorfx import planner
from tailorfx.budget import Budget, format_bytes, longest_fitting
from tailorfx.errors import BudgetError, PredictionError
from tailorfx.parallel import ParallelSpec
from tailorfx.parallel.entry import parallel_plan
from tailorfx.passes.attention.rules import drop_causal_sdpa_masks
from tailorfx.report import Report
from tailorfx import compat
from tailorfx.rewrite import bound, memory
from tailorfx.rewrite.capture import graph_device, mark_sequence_dims
from tailorfx.rewrite.regions import Region
from tailorfx.setup import OPTIMIZERS, TrainingSetup, resolve as resolve_setup, with_device_costs
from tailorfx.shallow import shallow_hint
from tailorfx import trainers


class OptimizedModule(trainers.TrainerHooks, nn.Module):
    """The model, compiled through tailorfx; shares the model's parameters.

    Inspect what was done with `.regions`, `.plan`, `.graphs`, `.report()`, `.diff(name)`,
    `.memory_timeline(path)` and `.predict_memory()`.
    """
    casts_own_precision = True   # its graph casts as the precision pass planned: callers add no autocast

    def __init__(self, model: nn.Module, options: Options, budget: Optional[Budget] = None):
        super().__init__()
        self.model = model
        self.budget = budget
        self.options = options
        self.session = Session()
        # kept out of the module tree: the compiled wrapper holds the same parameters
        self.__dict__["_compiled"] = self._compile(model)
        self.__dict__["_eager_reason"] = None
        self._look_like_the_model(self._forward)
        self._watch_trainers()

    def __getattr__(self, name: str):
        """Attributes the wrapper lacks come from the model (`config`, `generate`, ...), as for
        torch.compile's wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model" or "model" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["model"], name)

    def state_dict(self, *args, **kwargs):
        """The model's own state dict (no wrapper prefix): `model.load_state_dict(opt.state_dict())`."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a state dict of the model (as saved from the model or from this wrapper)."""
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The model's parameters under the names `model.named_parameters()` gives them (no
        wrapper prefix); under parallel=, this rank's shards (DTensors), and with pipeline
        stages only its stages' parameters."""
        plan = self.session.parallel
        mine = plan.runtime.rank_params if plan is not None else None
        for name, p in self.model.named_parameters(prefix, recurse, remove_duplicate):
            if mine is None or id(p) in mine:
                yield name, p

    def step(self, **batch):
        """Under parallel=: one training step's forward and backward. A pipeline's runs every
        micro-batch and returns the mean micro-batch loss on the last stage's ranks, None elsewhere;
        any other layout returns this rank's loss (the same call whatever parallel="auto" chose)."""
        plan = self.session.parallel
        if plan is None:
            raise ValueError("opt.step(**batch) is the training step of a parallel= layout; "
                             "otherwise call opt(**batch).loss.backward()")
        if plan.runtime.spec.pp > 1:
            return plan.runtime.step(batch)
        loss = self(**batch).loss
        loss.backward()
        return loss.detach()

    @torch.compiler.disable   # an outer torch.compile (Trainer's torch_compile=True) runs it as it is
    def _forward(self, *args, **kwargs):
        self._note_loop()
        if kwargs.get("fused_lm_head") and (out := self._fused_call(args, kwargs)) is not None:
            return out
        trainers.BypassWatch.ran(self.model.training and torch.is_grad_enabled())
        if self.session.parallel is not None:   # sharded by DTensor/FSDP2: runs as torch.distributed runs it
            return self.session.parallel.runtime.run(self.model, args, kwargs)
        kwargs = self.checkpointing_kwargs(kwargs)
        self.session.seq_len = mark_sequence_dims(args, kwargs)
        self.session.training = self.model.training
        self._check_budget_at(self.session.seq_len)
        if self._eager_reason is not None:
            return self.model(*args, **kwargs)
        try:
            with compat.capture_config():
                out = self._observed_call(self._compiled, args, kwargs)
            if not self.session.graphs and not self.session.warnings:
                self.session.warnings.append("Dynamo handed no graph to tailorfx (a skipped frame or its "
                                             "recompile limit): the model ran eagerly, nothing rewritten")
                warnings.warn(self.session.warnings[-1])
            return out
        except compat.dynamo_backend_failed() as e:
            if isinstance(getattr(e, "inner_exception", None), ValueError):
                raise e.inner_exception from e
            self._fall_back(e)
        except compat.dynamo_unsupported() as e:
            self._fall_back(e)
        return self.model(*args, **kwargs)

    def _observed_call(self, compiled: Callable, args: tuple, kwargs: dict):
        """Run a compiled callable; in a training call, record which graphs ran and whether they
        are the whole step (warn once if not: predictions and budgets then cannot cover it)."""
        if not (self.model.training and torch.is_grad_enabled()):
            return compiled(*args, **kwargs)
        obs, before = StepObservation(source=id(compiled)), len(self.session.graphs)
        self.session.observing = obs
        try:
            out = compiled(*args, **kwargs)   # may compile a graph (a cast model, a new batch size)
        finally:
            self.session.observing = None
        last, key = self.session.last_step, (obs.calls, obs.source, len(self.session.graphs))
        if obs.calls and (last is None or (last.calls, last.source, last.num_graphs) != key):   # a new step
            obs.outside = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in obs.params]
            obs.num_graphs = len(self.session.graphs)
            self.session.last_step = obs
            # the model's checkpointing turned on since (layers outside the graphs where Dynamo cannot trace
            # it, a graph compiled anew where it can): taken over, from the next call
            problems = obs.problems()
            taken = (problems or len(self.session.graphs) > before) and self._take_model_checkpointing(again=True)
            if problems and not taken:
                msg = ("the captured graphs are not the whole training step: " + "; ".join(problems) +
                       ". Memory predictions, budgets and max_seq_len cannot cover it: remove the graph break "
                       "(a print, logging or .item() in forward; TORCH_LOGS=graph_breaks names it)")
                if msg not in self.session.warnings:
                    self.session.warnings.append(msg)
                    warnings.warn(msg)
        return out

    def _check_budget_at(self, seq_len: Optional[int]) -> None:
        """A length other than the one planned for is re-checked against the budget (before it runs)."""
        peak = self._over_budget_at(seq_len)
        if peak is not None:
            planned = self.session.graphs[0].seq.length
            raise BudgetError(
                f"at sequence length {seq_len} the plan made for {planned} predicts a peak of "
                f"{format_bytes(peak)}, over the budget {self.budget}: call tailorfx.optimize again with "
                f"example inputs of this length (the planner then plans for it), or use shorter sequences",
                peak, "activations")

    def _over_budget_at(self, seq_len: Optional[int]) -> Optional[int]:
        """The step's predicted peak at `seq_len` under the plans made, when over the budget; None
        when it fits, was checked before, or cannot be predicted."""
        gs = self.session.graphs
        if self.budget is None or not seq_len or not gs or any(g.failed for g in gs) or gs[0].seq.symbol is None:
            return None
        checked = self.__dict__.setdefault("_checked_lengths", {gs[0].seq.length})
        if seq_len in checked:
            return None
        try:
            peak = self.predict_memory(seq_len).peak_bytes
        except PredictionError:   # the step is not all captured: already warned at capture
            return None
        if peak > self.budget.bytes:
            return peak
        checked.add(seq_len)
        return None

    def _fall_back(self, e: Exception) -> None:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # Dynamo's "Explanation:" line names the op it could not run (e.g. one with no fake impl)
        why = next((line[len("Explanation:"):].strip() for line in lines if line.startswith("Explanation:")), "")
        reason = (f"capture failed, running the model eagerly (nothing rewritten): {type(e).__name__}: "
                  f"{lines[0] if lines else ''}" + (f": {why}" if why else ""))
        self.__dict__["_eager_reason"] = reason
        self.session.warnings.append(reason)
        warnings.warn(reason)

    # ---- inspection -------------------------------------------------------------------------
    @property
    def graph_records(self) -> list[GraphRecord]:
        return list(self.session.graphs)

    @property
    def regions(self) -> list[Region]:
        """Regions found in every captured graph, in graph order."""
        return [r for g in self.session.graphs for r in g.regions.regions]

    @property
    def plan(self) -> list:
        return [g.plan for g in self.session.graphs]

    @property
    def graphs(self) -> dict:
        """Pass name -> graph after it ("capture" is the graph before any pass); '@i' for graph i>0."""
        out = {}
        for g in self.session.graphs:
            sfx = "" if g.index == 0 else f"@{g.index}"
            out["capture" + sfx] = g.original
            for r in g.records:
                out[r.name + sfx] = r.gm
        return out

    def diff(self, name: str) -> str:
        """Unified diff of the graph code before and after pass `name` (all graphs)."""
        recs = [r for g in self.session.graphs for r in g.records if r.name == name]
        if not recs:
            ran = sorted({r.name for g in self.session.graphs for r in g.records})
            raise KeyError(f"no pass named {name!r} ran; passes that ran: {ran or 'none'}")
        return "\n".join(r.diff() or f"(pass {name} left graph {r.graph_index} unchanged)" for r in recs)

    def report(self, **how) -> Report:
        """What was rewritten, the predicted peak before/after each pass, and how far the plan is from the
        bound on every plan's peak (rewrite/bound.py); `how`: predict_memory's outputs_held and as_eager."""
        return Report(self.session, self.budget, self._eager_reason, lambda S, rewritten: self.predict_memory(
            S, rewritten=rewritten, **how), self.limit, how.get("outputs_held", True))

    def bound_at(self, offload: Optional[bool] = None) -> Optional[Callable[[int], bound.Bound]]:
        """The lower bound on any plan's peak (rewrite/bound.py) as a function of the length, read off
        the one captured graph; None with several graphs, no blocks or no sequence symbol. `offload`:
        plans may keep checkpoints in host memory (default: when asked for, or planned for a GPU)."""
        gs = self.session.graphs
        if len(gs) != 1 or gs[0].failed or self.session.parallel is not None:
            return None
        # the static part (not a function of the length): the planner's estimate under this setup, else a trace
        setup, planned = self.setup, gs[0].plan.estimate if gs[0].plan is not None else None
        est = planned if planned is not None and planned.setup == setup else self.predict_memory()
        fixed = est.static_bytes + (setup.device.bytes(1) if setup.device is not None else 0)   # device: 1 token
        # a GPU's plans may keep checkpoints in host memory (the planner's last candidate there)
        if offload is None:
            offload = self.options.options_dict().get("offload") is not None or not planner.plans_for_cpu(
                graph_device(gs[0].rewritten), self.setup)
        return bound.bound_at(gs[0].rewritten, gs[0].seq, fixed, offload)

    def limit(self, offload: Optional[bool] = None) -> Optional[tuple[bound.Bound, Optional[int]]]:
        """(the bound at the last length seen, the longest length whose bound fits the budget, None
        without one); None when the graph gives no bound (see bound_at). `offload`: the bound's
        kind (default: the plan's own, with host offload where the plan offloads checkpoints)."""
        if offload is None:
            offload = any(g.plan.options.get("offload") is not None for g in self.session.graphs)
        at = self.bound_at(offload) if self.session.seq_len else None
        if at is None:
            return None
        longest = None
        if self.budget is not None:
            usable = planner.usable(self.budget.bytes, self.setup.headroom)
            longest = longest_fitting(lambda n: at(n).peak_bytes, usable, 1 << 24, 128)
        return at(self.session.seq_len), longest

    @property
    def setup(self) -> TrainingSetup:
        """The training setup the graphs were planned and lowered for (the planner may have moved
        the optimizer step into backward to fit the budget): those of the last training step first."""
        obs, gs = self.session.last_step, self.session.graphs
        for g in ([gs[i] for i in obs.calls] if obs is not None else []) + gs:
            if g.plan.options.get("setup") is not None:
                return g.plan.options["setup"]
        return self.options.options_dict()["setup"]

    def predict_memory(self, seq_len: Optional[int] = None, optimizer: Optional[str] = None, rewritten: bool = True,
                       setup: Any = None, outputs_held: bool = True, as_eager: bool = False) -> memory.MemoryEstimate:
        """Predicted memory of one training step at `seq_len` (default: the captured length), under the
        module's TrainingSetup unless `setup` (or, for short, `optimizer`) is given.
        `outputs_held=False`: the loop keeps only the loss (`loss = model(...).loss`, HF Trainer,
        tailorfx's train()), so the model's other outputs (logits, as captured) die with the forward.
        `as_eager` (with rewritten=False): as eager PyTorch runs it, not as traced: a causal mask (or a
        document mask of a batch of one document a row) that transformers skips dropped, k, v grouped."""
        if setup is not None:
            setup = resolve_setup(setup)
        elif optimizer is not None:
            setup = self.setup.with_(optimizer=optimizer, optimizer_in_backward=False, name=optimizer)
        else:
            setup = self.setup
        if self.session.parallel is not None:
            return self.session.parallel.prediction.predict(self.model, seq_len, setup)
        if not self.session.graphs:
            raise RuntimeError("nothing captured yet: call the module once or pass example_inputs")
        if failed := [w for g in self.session.graphs if g.failed for w in g.warnings]:
            raise PredictionError("cannot predict memory: " + "; ".join(failed))
        gs = self._step_graphs(seq_len)
        lowered = setup.optimizer_in_backward == self.setup.optimizer_in_backward   # g.step is what runs
        graphs = [(g.rewritten, g.lowering, g.step if lowered and (not g.step_static or seq_len in (None, g.seq.length))
                   else None) if rewritten else (drop_causal_sdpa_masks(g.original, g.single_document) if as_eager else g.original,
                                                 g.lowering, None) for g in gs]
        return planner.predict_graphs(graphs, [g.seq for g in gs], seq_len, setup, captured=True,
                                      outputs_held=outputs_held)

    def _step_graphs(self, seq_len: Optional[int]) -> list[GraphRecord]:
        """The graphs one training step runs (those the last training call ran, else every graph),
        or PredictionError when they are not the whole step or cannot follow `seq_len`."""
        obs, gs = self.session.last_step, self.session.graphs
        if obs is not None:
            problems = obs.problems()
            if problems:
                raise PredictionError("cannot predict one training step: " + "; ".join(problems))
            gs = [gs[i] for i in obs.calls]
        S = seq_len or gs[0].seq.length
        for g in gs:
            if g.seq.symbol is None and S != g.seq.length and _carries_sequence(g):
                raise PredictionError(
                    f"cannot predict S={S}: graph {g.index} was captured with static shapes at S={g.seq.length} "
                    f"(Dynamo compiled it after a graph break, from inputs that did not carry the marked "
                    f"sequence dimension), so its sizes do not follow the length; predict at S={g.seq.length}, "
                    f"or remove the graph break")
        return gs

    def memory_timeline(self, path: str, seq_len: Optional[int] = None, measured: Optional[int] = None) -> str:
        """Plot predicted live bytes over the step (before and after the passes) to a PNG."""
        from tailorfx.report import plot_timeline
        return plot_timeline(path, self.predict_memory(seq_len, rewritten=False),
                             self.predict_memory(seq_len), measured)

    def kernels(self) -> dict:
        """The Triton kernels this model runs (kernels="triton"), by spec name: each has `.source`
        (the generated Triton text) and `.compile(arch)` (80 or 90: registers, spills, shared
        memory and cubin, compiled here without a GPU). Empty when no Triton kernel runs."""
        from tailorfx.kernels import load
        return {name: load(spec) for name, (spec, _) in sorted(self.kernel_launches().items())}

    def kernel_launches(self) -> dict:
        """Spec name -> (spec, forward launch grid as text) of each Triton kernel the rewritten
        graphs launch, in graph order (the grid of its first launch, at the captured shapes)."""
        from tailorfx.passes.kernels import kernel_launches
        out: dict = {}
        for g in self.session.graphs:
            gm = g.records[-1].gm if g.records else g.original
            for n in gm.graph.nodes:
                for spec, grid in kernel_launches(n):
                    out.setdefault(spec.name, (spec, grid))
        return out


def _carries_sequence(g: GraphRecord) -> bool:
    """A graph input (other than a parameter) has a dimension of the captured sequence length."""
    from tailorfx.rewrite.capture import node_value
    from tailorfx.rewrite.regions import is_param
    return any(g.seq.dims(node_value(n)) for n in g.original.graph.nodes
               if n.op == "placeholder" and not is_param(n))


def optimize(model: nn.Module, budget: Union[str, int, Budget, None] = None,
             passes: Optional[Sequence[str]] = None, example_inputs: Any = None,
             example_kwargs: Optional[dict] = None, minisequence_chunks: Optional[int] = None,
             minisequence: Optional[str] = None, attention: Any = None, precision: Optional[str] = None,
             precision_policy: Optional[dict] = None, setup: Any = None,
             optimizer: Optional[str] = "adamw", recompute: Optional[str] = None, offload: Optional[str] = None,
             keep_logits: bool = False, strict: bool = False, lowering: str = "auto", verify: bool = True,
             predict: bool = True, parallel: Union[dict, ParallelSpec, str, None] = None,
             kernels: Optional[str] = None, attention_kernel: str = "auto") -> OptimizedModule:
    """Rewrite `model` for training under `budget`; returns a module that trains like the original.

    passes=None lets the planner choose (with a budget: the plan that fits with the least
    recompute, else BudgetError naming the smallest budget that works); passes=[] captures
    without rewriting. The budget covers what `setup` holds (a tailorfx.TrainingSetup or a preset
    name: weights, master weights, gradients, optimizer state, optimizer in backward; default:
    the model's dtype with `optimizer` "adamw", "sgd" or None) plus activations; if only moving
    the optimizer step into backward fits, the planner does so and says so (train with
    tailorfx.SetupOptimizer(model.parameters(), opt.setup)). In training with labels the fused LM
    head returns `logits=None` (Liger's skip_logits); `keep_logits=True` keeps them, head unfused.
    A pass named in `passes` that leaves a region unchanged warns with the region and the reason;
    `strict=True` raises instead. `precision_policy` overrides entries of the precision pass's
    policy. `recompute="full"|"full-except-attention"|"selective"` sets the recompute policy (the
    second saves each block's attention output: no attention forward again); `offload="checkpoints"`
    keeps each recomputed block's input in host memory between forward and backward (ALST's; recompute
    "full" unless `recompute` says), "activations" all it saves (selective). `minisequence="segments"` chunks
    each block's whole token-wise segments around attention, not only MLPs. With a budget and example
    input_ids and labels, a deep HF model is planned on a shallow capture of its config (shallow.py).
    Capture happens at the first call, or now when example inputs are given (their forward runs
    once). `parallel=dict(tp=2, dp=2)` (inside torchrun, example inputs required) shards the model
    with DTensor tensor parallelism, planned from its graph, and FSDP2; `pp=2, schedule="1f1b",
    microbatches=4` cuts its step graph into pipeline stages (train with `opt.step(**batch)`);
    `sp="ulysses"` splits sequences over the dp ranks (`parallel=`: a dict of
    tailorfx.parallel.ParallelSpec's fields, or a ParallelSpec); with `budget=`, the rewrites each
    rank takes are chosen so its predicted peak fits (least recompute first), else BudgetError.
    `parallel="auto"` (with a budget) lays the model out over the torchrun world as
    tailorfx.parallel.plan_world ranks the layouts: the fastest that fits, predicted on this
    machine (a GPU's figures by name, a CPU's measured); every rank takes its share of one global
    batch. `kernels="triton"` runs norms, gated activations, attention and the fused LM head as the
    runtime's Triton kernels (`opt.kernels()` lists them). `opt.report()` lists what went where. On
    a GPU a mask SDPA cannot run goes to the faster of the Triton flash kernel and FlexAttention per
    form and shape, timed once (`attention_kernel="auto"`), or to the one named ("flex", "triton").
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes an nn.Module, got {type(model).__name__}")
    if (inner := compat.compiled_original(model)) is not None:   # Trainer and accelerate unwrap it alike
        warnings.warn("optimize() was given torch.compile's wrapper: tailorfx compiles the model it wraps, with "
                      "its own backend (the wrapper's backend and options are not used)")
        model = inner
    plain = setup = _setup_for(model, setup, optimizer)
    examples = split_examples(example_inputs, example_kwargs)
    if budget is not None:   # a device preset: CUDA's workspaces at the example inputs' batch (1 without them)
        budget = Budget.parse(budget)
        setup = with_device_costs(setup, budget, model, batch_of(*examples))
    b, opts = pass_options(budget=budget, minisequence_chunks=minisequence_chunks, minisequence=minisequence,
                           attention=attention, attention_kernel=attention_kernel, precision=precision,
                           precision_policy=precision_policy, setup=setup, recompute=recompute, offload=offload,
                           keep_logits=keep_logits, strict=strict, kernels=kernels)
    if kernels == "triton":
        from tailorfx.kernels import check_triton
        check_triton(model)
    if b is not None and passes is None and parallel is None:   # a deep model planned on a shallow capture
        opts["plan_hint"] = shallow_hint(model, b, plain, examples, opts, lowering, optimize)
    options = Options(passes=check_passes(passes), pass_options=tuple(sorted(opts.items())),
                      lowering=lowering, predict=check_flag("predict", predict), verify=check_flag("verify", verify))
    if parallel is not None:
        return _parallel_module(model, options, b, parallel, *examples)
    opt = OptimizedModule.like(model)(model, options, b)
    if example_inputs is not None or example_kwargs is not None:
        opt(*examples[0], **examples[1])
        opt._bypass.forget_calls()    # no backward follows the example call
    return opt


def _parallel_module(model: nn.Module, options: Options, budget: Optional[Budget], parallel: Any,
                     args: tuple, kwargs: dict) -> OptimizedModule:
    """optimize(parallel=...): the layout (given, or "auto") applied with torch.distributed."""
    plan = parallel_plan(model, parallel, args, kwargs, budget=budget, requested=options.passes,
                         options=options.options_dict())
    opt = OptimizedModule.like(model)(model, options, budget)
    opt.session.parallel = plan
    return opt


def _setup_for(model: nn.Module, setup: Any, optimizer: Optional[str]) -> TrainingSetup:
    """The TrainingSetup to plan for; the model's parameters must already be in its dtype."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if setup is None:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        return resolve_setup(None, param_dtype=next(iter(dtypes)) if len(dtypes) == 1 else None, optimizer=optimizer)
    s = resolve_setup(setup)
    if optimizer not in ("adamw", s.optimizer):
        raise ValueError(f"optimizer={optimizer!r} disagrees with setup {s.name!r} (optimizer "
                         f"{s.optimizer!r}); give the optimizer in the TrainingSetup only")
    if dtypes and dtypes != {s.param_dtype}:
        have = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(f"setup {s.name!r} trains {s.param_dtype} parameters but the model's are {have}: "
                         f"call model.to({s.param_dtype}) first (tailorfx does not cast your model)")
    return s
