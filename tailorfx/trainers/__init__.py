"""How an optimized model meets the trainers that call it: TRL's fused LM head, served by
tailorfx's graph, and the watch that says when a training step ran without that graph.

TRL's trainers (SFT, DPO, KTO, GRPO, RLOO) call `trl.trainer.utils.add_fused_lm_head(model)`,
which replaces `model.forward` with a function that runs `model.base_model` and TRL's own chunked
log-prob head; given an OptimizedModule, that backbone is the unoptimized one. OptimizedModule
recognizes the replacement (`trl_fused_head`) and serves `fused_lm_head=True` calls with
`LogProbStep` compiled through tailorfx: the planner's rewrites on the backbone and one fused head,
ours (runtime/log_prob_ops.py), sized by the budget and counted by the memory model, which TRL's
fixed 4,096-token x 32,768-column fp32 tiles are not. Every other call goes through TRL's
function as before.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
import weakref
from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.nn as nn

from tailorfx import compat, planner
from tailorfx.backend import TailorBackend
from tailorfx.budget import format_bytes
from tailorfx.errors import PredictionError
from tailorfx.options import Options
from tailorfx.parallel.plan import accepts_use_cache
from tailorfx.rewrite.capture import mark_sequence_dims
from tailorfx.runtime.optim import updater_for
from tailorfx.trainers.trl_head import LogProbStep, TrlHead, adapted_model, trl_fused_head, trl_output
from tailorfx.trainers.watch import BypassWatch, bypass_message, describe

__all__ = ["TrainerHooks", "BypassWatch", "with_checkpointing", "CHECKPOINTING_NOTE", "CACHE_NOTE", "INPUT_GRADS_NOTE"]

CHECKPOINTING_NOTE = ("gradient checkpointing asked for (gradient_checkpointing_enable, as trainers call it): run by "
                      "tailorfx's recompute pass (every block recomputed in full, or under a budget the blocks the "
                      "planner picks), not by torch.utils.checkpoint around the layers, which no pass can see into")


CACHE_NOTE = ("gradient checkpointing: training calls run with use_cache=False, as transformers' own checkpointing "
              "sets it, so the layers fill no KV cache (past_key_values is None)")


INPUT_GRADS_NOTE = ("enable_input_require_grads (peft with gradient checkpointing): no hook registered; tailorfx's "
                    "recompute pass does not need the embeddings' output to require grad, and the hook would split "
                    "the step into three graphs")


def with_checkpointing(options: Options, budgeted: bool, offload: bool = False) -> Options:
    """`options` with the blocks recomputed, as a trainer's activation checkpointing asks: the
    recompute pass added to named passes, the policy "full" unless given or a budget lets the
    planner choose, and the checkpoints in host memory when it asks for offload."""
    opts = options.options_dict()
    if options.passes is not None and "recompute" not in options.passes:
        options = replace(options, passes=(*options.passes, "recompute"))
    if opts.get("recompute_policy") is None and not budgeted:
        opts["recompute_policy"] = "full"
    if offload and opts.get("offload") is None:
        opts["offload"] = "checkpoints"
    return replace(options, pass_options=tuple(sorted(opts.items(), key=lambda kv: kv[0])))


@functools.lru_cache(maxsize=None)
def _wrapper_like(cls: type, model_cls: type, causal_lm_cls: type) -> type:
    def forward(self, *args, **kwargs):
        return self.__dict__["forward"](*args, **kwargs)     # the instance's, which Module.__call__ finds first
    try:
        forward.__signature__ = inspect.signature(causal_lm_cls.forward)
    except (TypeError, ValueError):      # a forward without a signature to read: the wrapper's own
        pass
    name = causal_lm_cls.__name__

    def __repr__(self):      # Module's repr starts with _get_name(): the wrapper's own name instead
        return type(self).__name__ + nn.Module.__repr__(self)[len(name):]

    def set_class(self, new: type) -> None:      # FSDP2's fully_shard gives a module a class of its own
        object.__dict__["__class__"].__set__(self, new)
    # isinstance() reads `__class__` where type() does not answer (as wrapt's proxies do it)
    the_models_class = property(lambda self: model_cls, set_class)
    return type(f"Optimized{name}", (cls,), {"forward": forward, "_get_name": lambda self: name, "__repr__": __repr__,
                                              "__class__": the_models_class, "_plain": cls,
                                              "__module__": cls.__module__, "__doc__": cls.__doc__})


def _copied(cls: type, model: nn.Module, options: Options, budget, training: bool, state: dict) -> nn.Module:
    """A copy of an optimized module (TrainerHooks.__reduce_ex__): its model optimized again, as it was."""
    opt = cls.like(model)(model, options, budget)
    opt.training = training
    opt.__dict__.update(state)
    return opt


def warn_once(session, msg: str) -> None:
    if msg not in session.warnings:
        session.warnings.append(msg)
        warnings.warn(msg, stacklevel=3)


def note_once(session, msg: str) -> None:
    if msg not in session.notes:
        session.notes.append(msg)


def unserved_head(head: str) -> str:
    """The warning for TRL's fused head with options tailorfx's head lacks (`head` says which)."""
    return f"TRL's fused LM head is not served by tailorfx: {head}; TRL's head will run on the unoptimized backbone"


class TrainerHooks:
    """OptimizedModule's side that trainers meet: TRL's fused head served (a replaced `forward`
    watched), activation checkpointing run as the recompute pass, and the bypass watch. Reads
    the module's `model`, `options`, `budget` and `session`."""

    @classmethod
    def like(cls, model: nn.Module) -> type:
        """`cls` as trainers read it for `model`: a subclass whose class-level `forward` has the
        signature of the model's (Trainer finds its label names in `type(model).forward`; on the
        plain wrapper it found none, so `evaluate()` computed no eval_loss), whose `_get_name()` is
        the model's (Trainer's label smoothing shifts the labels of a causal LM it names), and whose
        instances are instances of the model's class to `isinstance` (`type()` still names the
        wrapper): Trainer saves a `PreTrainedModel` with `save_pretrained` (config and tied weights;
        otherwise a bare state dict, which safetensors refuses for tied embeddings), TRL and
        accelerate treat a `PeftModel` as one (its reference the adapters disabled, its checkpoints
        the adapters)."""
        return _wrapper_like(cls, type(model), type(adapted_model(model)))

    def __dir__(self):
        return sorted(set(nn.Module.__dir__(self)) | set(dir(type(self))))

    def named_modules(self, memo: Optional[set] = None, prefix: str = "", remove_duplicate: bool = True):
        """This wrapper, then the model's modules under the names `model.named_modules()` gives them
        (no wrapper prefix), as `named_parameters` names their parameters: a tool that finds modules
        and then their parameters by name (peft's get_peft_model, as SFTTrainer(peft_config=) calls
        it) sees one namespace. (Under two, peft froze the adapters it had just added.)"""
        memo = set() if memo is None else memo
        if not remove_duplicate or self not in memo:
            memo.add(self)
            yield prefix, self
        yield from self.model.named_modules(memo, prefix, remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        """The model's submodule at `target`, a name `named_modules()` gives (this wrapper at "")."""
        return self if target == "" else self.model.get_submodule(target)

    def _look_like_the_model(self, run: Callable) -> None:
        """`forward` calls `run` under the model's signature: Trainer and accelerate read it to keep a
        batch's columns (peft's is `(*args, **kwargs)`, so Trainer reads its base model's: given it here)."""
        model = self.model

        @functools.wraps(model.forward)
        def forward(*args, **kwargs):
            return run(*args, **kwargs)
        if (base := adapted_model(model)) is not model:
            forward.__signature__ = inspect.signature(base.forward)
        self.__dict__["forward"] = self.__dict__["_own_forward"] = forward

    def __reduce_ex__(self, protocol: int):
        """copy.deepcopy (a reference model, an EMA) and torch.save copy the model and the options, as
        torch.compile's wrapper does: the copy optimizes its own model again at its first call (this
        module's graphs and forward read this model's parameters, so a copy of them would train these)."""
        why = None
        if self.session.parallel is not None:
            why = "its model is sharded (parallel=): copy the model before optimize()"
        elif self.__dict__["forward"] is not self._own_forward:
            why = (f"its forward was replaced ({describe(self.__dict__['forward'])}): copy the model before "
                   f"optimize() and the replacement")
        if why is not None:
            raise TypeError(f"cannot copy or pickle this tailorfx module: {why}, or save opt.state_dict()")
        state = {k: v for k, v in self.__dict__.items() if k in ("_checkpointing", "_options_before_checkpointing")}
        return _copied, (type(self)._plain, self.model, self.options, self.budget, self.training, state)

    def _watch_trainers(self) -> None:
        self.__dict__["_replaced_forward"] = None   # what replaced forward, when tailorfx cannot serve it
        self.__dict__["_trl_step"] = None   # (TrlHead, its compiled LogProbStep, whether a training call ran it)
        me = weakref.ref(self)
        watch = BypassWatch(self.model.parameters(), lambda: me() is not None and me()._on_bypass())
        self.__dict__["_bypass"] = watch
        weakref.finalize(self, BypassWatch.close, watch)

    def _compile(self, module: nn.Module):
        """`module` compiled by a tailorfx backend of this module's options and session."""
        return compat.compile_apart(module, backend=TailorBackend(self.options, self.session, owner_holds_session=True),
                                    dynamic=None)

    def __setattr__(self, name: str, value) -> None:
        """A replaced `forward` (TRL's add_fused_lm_head replaces it on the object it is given) is
        served by tailorfx's graph where tailorfx knows what it computes (TRL's fused head), else
        kept and, once a training step runs through it without tailorfx's graph, said."""
        if name == "forward" and "forward" in self.__dict__:
            self._replace_forward(value)
        else:
            super().__setattr__(name, value)

    def _replace_forward(self, fn) -> None:
        head = trl_fused_head(fn, self.model)
        if not isinstance(head, TrlHead):
            self.__dict__["forward"] = fn
            self.__dict__["_replaced_forward"] = describe(fn) + (f" ({head})" if head else "")
            if head:   # TRL's, with options tailorfx's head lacks: its head runs on the unoptimized backbone
                warn_once(self.session, unserved_head(head))
            return
        serve = self._trl_forward

        @functools.wraps(fn)
        def forward(*args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
            if not fused_lm_head:   # TRL's function, which calls tailorfx's forward
                return fn(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                          **kwargs)
            return serve(head, args, kwargs, labels, shift_labels, num_items_in_batch)
        self.__dict__["forward"] = forward
        self.__dict__["_replaced_forward"] = None
        self._note_served(fn, head)

    def _fused_call(self, args: tuple, kwargs: dict):
        """A `fused_lm_head=True` call that reached the wrapper's own forward: TRL put its head on the
        causal LM under the PeftModel this wraps (TRL patches `get_base_model()` of a model accelerate
        calls a PeftModel, as this one is to isinstance). Served as if it had replaced this module's
        forward; None where no head of TRL's is there (the call runs as it is)."""
        fn = vars(adapted_model(self.model)).get("forward")
        seen = self.__dict__.get("_inner_head")
        if seen is None or seen[0] is not fn:
            seen = (fn, None if fn is None else trl_fused_head(fn, self.model))
            self.__dict__["_inner_head"] = seen
            if isinstance(seen[1], TrlHead):
                self._note_served(fn, seen[1])
        head = seen[1]
        if head is None:
            return None
        kwargs = dict(kwargs)
        kwargs.pop("fused_lm_head")
        labels, shift_labels, n = (kwargs.pop(k, None) for k in ("labels", "shift_labels", "num_items_in_batch"))
        if isinstance(head, str):   # TRL's, with options tailorfx's head lacks: as the model runs it
            warn_once(self.session, unserved_head(head))
            return self.model(*args, fused_lm_head=True, labels=labels, shift_labels=shift_labels,
                              num_items_in_batch=n, **kwargs)
        return self._trl_forward(head, args, kwargs, labels, shift_labels, n)

    def _note_served(self, fn, head: TrlHead) -> None:
        note = (f"TRL's fused LM head ({describe(fn)}, outputs {', '.join(head.outputs)}) is served by "
                f"tailorfx: fused_lm_head=True calls run the backbone's rewritten graph and tailorfx's chunked "
                f"log-prob head (one fused head, sized by the plan), not TRL's")
        note_once(self.session, note)

    def _note_loop(self) -> None:
        """What the loop around the model holds besides the step, found at its calls and said once:
        DDP's gradient buckets, gradients accumulated over micro-batches (_loop_holds)."""
        self._take_model_checkpointing()
        self._note_ddp()
        self._note_accumulation()

    def _take_model_checkpointing(self, again: bool = False) -> bool:
        """A model given with transformers' activation checkpointing on: torch.utils.checkpoint around each
        layer hides its MLP from every pass (and under transformers 5.25's hub-kernel wrappers Dynamo
        skips the model), so at the first call (`again`: at a step that ran layers outside every graph or
        compiled a graph anew) it is turned off in the model and served by tailorfx's recompute pass, as a trainer's
        activation_checkpointing_enable() is; True if it was. Not under parallel=."""
        if ("_model_checkpointing_seen" in self.__dict__ and not again) or self.session.parallel is not None:
            return False
        self.__dict__["_model_checkpointing_seen"] = True
        model = self.model
        on = getattr(model, "is_activation_checkpointing", None)   # transformers' name; before 5.x the other
        if not (on if on is not None else getattr(model, "is_gradient_checkpointing", False)):
            return False
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        self._set_checkpointing(True)
        how = ("had transformers' activation checkpointing on (turned on after optimize())" if again
               else "came with transformers' activation checkpointing on")
        note_once(self.session, f"the model {how}: turned off in the model (torch.utils.checkpoint around each "
                                f"layer hides its MLP from every pass) and served by tailorfx's recompute pass")
        return True

    def _note_ddp(self) -> None:
        """Inside DistributedDataParallel (Trainer or accelerate on several processes): the step is one
        graph (capture_config) whose setup counts DDP's gradient buckets (setup.ddp); an optimizer step
        in backward is refused (docs/usage.md)."""
        ddp = compat.active_ddp()
        if ddp is None or self.__dict__.get("_ddp_seen") == id(ddp):
            return
        if in_backward := [n for n, p in self.model.named_parameters() if updater_for(p) is not None]:
            raise ValueError(f"a tailorfx.SetupOptimizer updates {in_backward[0]} (and {len(in_backward) - 1} more) "
                             f"in backward, before DistributedDataParallel averages its gradient over the ranks (the "
                             f"ranks' weights would drift apart): under DDP make it with a setup whose "
                             f"optimizer_in_backward=False, or shard with optimize(..., parallel=dict(dp=N)) (FSDP2)")
        self.__dict__["_ddp_seen"] = id(ddp)
        self._loop_holds()
        copy = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        note_once(self.session, (
            "inside DistributedDataParallel: the step is one graph (Dynamo's DDPOptimizer would cut it at "
            "DDP's gradient buckets, leaving regions across a cut as captured); DDP all-reduces the gradients "
            "once the backward has made them all, so communication does not overlap the backward; its buckets "
            f"hold a copy of the gradients, {format_bytes(copy)} on each rank, in the predicted peak (static)"))

    def _note_accumulation(self) -> None:
        """A training call that finds gradients on the parameters (Trainer's gradient_accumulation_steps,
        accelerate's accumulate, a loop that keeps them or clears them only after the forward): they are
        held through the forward, where the step peaks, so the step is predicted and planned as
        setup.grad_accum_steps 2 (any count > 1 peaks alike) from then on."""
        if self.session.accumulating or self.session.parallel is not None or not (
                self.model.training and torch.is_grad_enabled()):
            return
        if not any(p.grad is not None for p in self.model.parameters() if p.requires_grad):
            return
        self.session.accumulating = True
        self._loop_holds()
        note_once(self.session, "gradients were held at a training call (accumulated over micro-batches, or cleared "
                                "only after the forward): the step is predicted and planned with them held "
                                "(grad_accum_steps 2)")

    def _loop_holds(self) -> None:
        """Training steps captured before the loop showed what it holds take it into their setup
        (TrainingSetup.held_by_loop, as the backend plans those captured later), so predictions count
        it; under a budget, a step that then no longer fits, or whose optimizer step the planner moved
        into backward where DDP rules that out, is captured and planned again at the next call."""
        again, asked = False, self.options.options_dict().get("setup")
        ddp, accumulating = compat.active_ddp() is not None, self.session.accumulating
        steps = [g for g in self.session.graphs if g.plan.options.get("training") and g.plan.options.get("setup")]
        for g in steps:
            try:
                g.plan = replace(g.plan, options={**g.plan.options,
                                                  "setup": g.plan.options["setup"].held_by_loop(ddp, accumulating)})
            except ValueError:
                if asked is not None and asked.optimizer_in_backward:
                    raise   # the user's own step in backward: the error says why and what to do
                again = True   # the planner's: planned again without it
        if not again and self.budget is not None and self.session.graphs:
            with contextlib.suppress(PredictionError):
                again = self.predict_memory().peak_bytes > planner.usable(self.budget.bytes, self.setup.headroom)
        if again:
            held = " and ".join(["DDP's gradient buckets"] * ddp + ["gradients held over the step"] * accumulating)
            for g in steps:
                g.replaced = g.replaced or f"planned again with {held}"
            self.__dict__["_compiled"], self.__dict__["_trl_step"] = self._compile(self.model), None
            self.__dict__.pop("_compiled_by_options", None)
            self.session.last_step = None

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: Optional[dict] = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """What trainers call for activation checkpointing (HF Trainer, TRL's default
        `gradient_checkpointing=True`): tailorfx's recompute pass recomputes the blocks (every
        block in full, or under a budget the blocks the planner picks; `offload=True` keeps their
        checkpoints in host memory, offload="checkpoints"), not torch.utils.checkpoint around the
        layers, which no pass can see into. Graphs compiled from now on take it."""
        self._set_checkpointing(True, offload)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Optional[dict] = None,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        """transformers' older name of activation_checkpointing_enable."""
        self._set_checkpointing(True, offload)

    def activation_checkpointing_disable(self) -> None:
        """Undoes activation_checkpointing_enable (graphs compiled from now on)."""
        self._set_checkpointing(False)

    gradient_checkpointing_disable = activation_checkpointing_disable

    def enable_input_require_grads(self) -> None:
        """What trainers call for peft with gradient checkpointing (TRL's, transformers'): a hook that
        makes the embeddings' output require grad, which torch.utils.checkpoint's reentrant form
        needs. tailorfx's recompute pass needs none, and the hook's `requires_grad_()` would split
        Dynamo's capture into three graphs (the head apart from the backbone, so no pass fuses it):
        not registered, said in the report. Under `parallel=`, where checkpointing is the model's
        own, the model's hook is registered."""
        if self.session.parallel is not None:
            self.model.enable_input_require_grads()
        else:
            note_once(self.session, INPUT_GRADS_NOTE)

    def disable_input_require_grads(self) -> None:
        """Undoes enable_input_require_grads."""
        if self.session.parallel is not None:
            self.model.disable_input_require_grads()
        elif INPUT_GRADS_NOTE in self.session.notes:
            self.session.notes.remove(INPUT_GRADS_NOTE)

    def checkpointing_kwargs(self, kwargs: dict) -> dict:
        """A training call's kwargs while tailorfx serves activation checkpointing: use_cache=False,
        as transformers' own checkpointing sets it in each layer, so the layers fill no KV cache (a
        step of recomputed blocks would otherwise hold every layer's keys and values to the
        forward's end: 16% of a 4-layer Llama's peak at 2 x 1,024 tokens). Said once in the report."""
        if not (self.is_activation_checkpointing and self.model.training and torch.is_grad_enabled()) \
                or kwargs.get("use_cache") is False or not accepts_use_cache(adapted_model(self.model)):
            return kwargs
        note_once(self.session, CACHE_NOTE)
        return {**kwargs, "use_cache": False}

    @property
    def is_activation_checkpointing(self) -> bool:
        return bool(self.__dict__.get("_checkpointing"))

    is_gradient_checkpointing = is_activation_checkpointing

    def _set_checkpointing(self, on: bool, offload: bool = False) -> None:
        if on == self.is_activation_checkpointing or self.session.parallel is not None:
            return
        self.__dict__["_checkpointing"] = on
        base = self.__dict__.setdefault("_options_before_checkpointing", self.options)
        # trainers toggle it around a reference forward on every step (TRL's DPO): the compiled
        # modules of each options are kept, so a toggle back reuses their graphs, not captures anew
        kept = self.__dict__.setdefault("_compiled_by_options", {})
        kept[self.options] = (self._compiled, self._trl_step)
        self.options = with_checkpointing(base, self.budget is not None, offload) if on else base
        compiled, trl_step = kept.get(self.options) or (self._compile(self.model), None)
        self.__dict__["_compiled"], self.__dict__["_trl_step"] = compiled, trl_step
        note = CHECKPOINTING_NOTE
        if on and note not in self.session.notes:
            self.session.notes.append(note)
        elif not on and note in self.session.notes:
            self.session.notes.remove(note)

    def _on_bypass(self) -> None:
        warn_once(self.session, bypass_message(self._replaced_forward))

    @torch.compiler.disable   # under an outer torch.compile, as _forward
    def _trl_forward(self, head: TrlHead, args: tuple, kwargs: dict, labels, shift_labels,
                     num_items_in_batch):
        """TRL's `fused_lm_head=True` call through tailorfx: LogProbStep compiled by the same
        backend and session (planned under the same budget), its outputs as TRL's."""
        BypassWatch.ran(self.model.training and torch.is_grad_enabled())
        self._note_loop()   # TRL's replaced forward comes here, not through _forward
        if self.session.parallel is not None or self._eager_reason is not None:
            warn_once(self.session, "TRL's fused LM head runs as TRL wrote it (its head on the backbone): "
                      + ("tailorfx does not serve it under parallel=" if self.session.parallel is not None
                         else self._eager_reason))
            # TRL's function on the causal LM (under a LoRA wrapper, as TRL patches a PeftModel's)
            func = getattr(head.patched, "__func__", None)
            trl_forward = head.patched if func is None else functools.partial(func, adapted_model(self.model))
            return trl_forward(*args, fused_lm_head=True, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        call = {**kwargs, **({"labels": labels} if shift_labels is None else {"shift_labels": shift_labels})}
        self.session.seq_len = mark_sequence_dims(args, call)
        self.session.training = self.model.training
        # the lengths a trainer feeds are its own (a packed row holds a whole batch): a length the
        # plan made does not fit gets a plan of its own, compiled at it (or BudgetError there)
        if self._trl_step is None or self._trl_step[0] is not head or (
                self._trl_step[2] and self._over_budget_at(self.session.seq_len) is not None):
            step = LogProbStep(self.model, head)
            self.__dict__["_trl_step"] = (head, self._compile(step), False)
            self.__dict__.pop("_checked_lengths", None)
        with compat.capture_config():
            out = self._observed_call(self._trl_step[1], args, call)
        if self.model.training and torch.is_grad_enabled():
            self.__dict__["_trl_step"] = (*self._trl_step[:2], True)   # its training graph is observed
        return trl_output(head, *out, num_items_in_batch)
