"""Tensor-parallel plan inferred from the captured graph, not from class names.

Megatron's split, found by dataflow: a linear whose input is replicated (it fans out of a norm)
is column-parallel; its output features are then sharded, and that sharding is followed through
the ops that keep features apart (views that split features into heads, transposes, rotary,
attention per head, SwiGLU's product) until it reaches the linear that contracts over it: that
one is row-parallel (its all-reduce returns the residual stream to replicated). A replicated
operand that must be sharded like the others (k and v next to q, `up` next to `gate`) pulls its
own linear into the group. Any op that would mix the sharded features (a norm over the whole
projection, a softmax over a router's experts, a split of a fused qkv) leaves the whole group
replicated, with the reason: exact, never a silent wrong result.

    before: norm -> q,k,v -> view(-1, D) -> rope -> sdpa -> reshape -> o -> + residual
    plan:   q,k,v colwise (heads split over the tp ranks), o rowwise
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from tailorfx.parallel.shapes import getitem_keeps, perm_dim, same, shape_of, view_dim
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.regions import is_param, is_weight_matmul, module_paths

# ops that keep a sharded dim where it is (elementwise, casts, copies)
_SAME = frozenset({"to", "float", "type", "half", "bfloat16", "contiguous", "clone", "dropout", "neg", "silu",
                   "gelu", "relu", "sigmoid", "tanh", "exp", "pow", "mul", "add", "sub", "div", "truediv",
                   "where", "masked_fill", "alias", "detach", "rsqrt", "sqrt", "square", "abs", "erf",
                   "softplus", "gelu_tanh", "cat", "concat", "type_as"})
_REDUCE = frozenset({"mean", "sum", "var", "std", "amax", "max", "min", "norm", "softmax", "log_softmax",
                     "rms_norm", "layer_norm", "logsumexp", "argmax", "topk"})
_VIEWS = frozenset({"view", "reshape", "flatten", "unflatten", "expand", "unsqueeze", "squeeze", "stack"})


@dataclass
class Group:
    """Linears that must be sharded together: `colwise` outputs sharded, `rowwise` contracts them."""
    colwise: list[str] = field(default_factory=list)
    rowwise: list[str] = field(default_factory=list)
    heads: dict[str, int] = field(default_factory=dict)    # colwise fqn -> heads its output splits into
    widths: dict[str, int] = field(default_factory=dict)   # colwise fqn -> output features
    params: dict = field(default_factory=dict)    # replicated param node read inside -> its sharded dim
    region: set = field(default_factory=set)      # nodes whose values are sharded


@dataclass
class TPPlan:
    """Module fqn -> "colwise" | "rowwise" | "sharded_input:D" | the head's "colwise_vocab_parallel"
    (it feeds a loss) or "colwise_gather_output" | the token embedding's "rowwise_embedding" (split
    by vocabulary where the head is); the rest stays replicated."""
    styles: dict[str, str]
    groups: list[Group]
    replicated: dict[str, str]    # linear fqn -> why it is not sharded
    sequence: dict[str, str] = field(default_factory=dict)   # sp="megatron": styles replacing or adding to styles
    sequence_error: Optional[str] = None                     # why sp="megatron" cannot split this model's stream
    # a vocab-parallel head's loss fused with it (runtime/vocab_parallel.py): the (softcap, logit
    # scale) between them, or why the loss runs on the logits shard under loss_parallel instead
    head_loss: Any = None
    mlps: tuple = ()      # the token-wise MLPs' module paths (mini-sequence under tp chunks them)

    def check(self, tp: int) -> None:
        """ValueError naming the first count `tp` does not divide, and the tp values that work."""
        counts = [(f, n, "heads") for g in self.groups for f, n in g.heads.items()]
        counts += [(f, n, "output features") for g in self.groups for f, n in g.widths.items() if f not in g.heads]
        for fqn, n, what in counts:
            if n % tp:
                ok = math.gcd(*[c for _, c, _ in counts]) if counts else 1
                good = [d for d in range(1, ok + 1) if ok % d == 0]
                raise ValueError(f"tp={tp} does not divide the {n} {what} of {fqn} (read from its graph): "
                                 f"choose tp in {good}")

    def describe(self) -> list[str]:
        lines = [f"{fqn}: {style}" for fqn, style in self.styles.items()]
        return lines + [f"{fqn}: replicated ({why})" for fqn, why in self.replicated.items()]


def linear_modules(gm: fx.GraphModule, values: dict, names: dict, model: torch.nn.Module
                   ) -> tuple[dict[fx.Node, Optional[str]], dict[fx.Node, str]]:
    """Weight-matmul node -> fqn of the nn.Linear that owns its weight (None if no nn.Linear does),
    and node -> "fqn (Type)" of every weight's owner, for the report. `values`: placeholder ->
    example input; `names`: placeholder -> parameter name (`param_names`)."""
    mods = dict(model.named_modules(remove_duplicate=False))
    out, owner = {}, {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not is_weight_matmul(n):
            continue
        w = next((a for a in n.all_input_nodes if a in names and values[a].dim() >= 2), None)
        if w is None:
            continue
        fqn = names[w].rsplit(".", 1)[0]
        linear = match.op_name(n) == "linear" and n.args[1] is w
        out[n] = fqn if linear and isinstance(mods.get(fqn), torch.nn.Linear) else None
        owner[n] = fqn if out[n] else f"{fqn} ({type(mods.get(fqn)).__name__})"
    return out, owner


class _Propagation:
    """Follows one group's sharded dim through the graph; `fail` holds the reason it cannot."""

    def __init__(self, linears: dict[fx.Node, str]):
        self.linears = linears
        self.sharded: dict[fx.Node, int] = {}
        self.group = Group()
        self.pull: list[fx.Node] = []     # replicated linears the group must take in
        self.fail: Optional[str] = None

    def run(self, starts: list[fx.Node]) -> None:
        order = {n: i for i, n in enumerate(starts[0].graph.nodes)}
        for s in starts:
            self.sharded[s] = len(shape_of(s)) - 1
            self.group.colwise.append(self.linears[s])
            self.group.widths[self.linears[s]] = int(shape_of(s)[-1])
        todo = sorted({u for s in starts for u in s.users}, key=order.get)
        seen = set()
        while todo and self.fail is None:
            n = todo.pop(0)
            if n in seen or n in self.sharded:
                continue
            seen.add(n)
            if self._step(n):
                todo = sorted(set(todo) | set(n.users), key=order.get)

    def _step(self, n: fx.Node) -> bool:
        """Sharded dim of `n` from its inputs; False when `n` ends the walk (a row-parallel linear)."""
        name = match.op_name(n)
        ins = [a for a in n.all_input_nodes if a in self.sharded]
        if n.op == "output":
            return False
        if n in self.linears:
            return self._contracting(n, ins)
        if name == "scaled_dot_product_attention":
            return self._attention(n)
        dim = self.sharded[ins[0]]
        out = shape_of(n)
        if name in _VIEWS or name == "getitem":
            if name == "getitem" and not getitem_keeps(n, dim):
                return self._stop(f"slicing at {n.name} cuts the sharded features (a fused projection)")
            dim = view_dim(shape_of(ins[0]), out, dim)
        elif name in ("transpose", "permute", "movedim", "swapaxes"):
            dim = perm_dim(n, dim, len(out or ()))
        elif name in ("matmul", "bmm"):    # q @ k^T, p @ v: per head, the batch-like dim stays
            ops = [a for a in n.args[:2] if isinstance(a, fx.Node)]
            if any(a not in self.sharded for a in ops):
                return self._pull([a for a in ops if a not in self.sharded], n)
            if len({self.sharded[a] for a in ops}) != 1 or dim >= len(out) - 2:
                return self._stop(f"{name} at {n.name} contracts over the sharded features")
        elif name in _REDUCE:
            d = match.dim_arg(n)
            dims = d if isinstance(d, (list, tuple)) else [d]
            nd = len(shape_of(ins[0]))
            if d is None or any((x % nd) == dim for x in dims if isinstance(x, int)):
                return self._stop(f"{name} at {n.name} reduces over the sharded features")
        elif name in ("cat", "concat") and (match.dim_arg(n) or 0) % len(out or (0,)) == dim:
            return self._stop(f"{name} at {n.name} joins along the sharded features")
        elif name not in _SAME:
            return self._stop(f"{name} at {n.name} is not known to keep the feature split")
        if dim is None:
            return self._stop(f"{name} at {n.name} merges or splits the sharded features")
        if not self._operands_agree(n, dim, out):
            return False
        self._note_heads(n, ins[0], dim)
        self.sharded[n] = dim
        return True

    def _contracting(self, n: fx.Node, ins: list) -> bool:
        if not ins or n.args[0] not in self.sharded or self.sharded[n.args[0]] != len(shape_of(n.args[0])) - 1:
            return self._stop(f"linear {n.name} reads the sharded tensor other than over its features")
        if self.linears[n] is None:
            return self._stop(f"linear {n.name}'s weight is not an nn.Linear's")
        if self.linears[n] not in self.group.rowwise:
            self.group.rowwise.append(self.linears[n])
        return False

    def _attention(self, n: fx.Node) -> bool:
        qkv = [a for a in n.args[:3] if isinstance(a, fx.Node)]
        missing = [a for a in qkv if a not in self.sharded]
        if missing:
            return self._pull(missing, n)
        if any(self.sharded[a] != 1 for a in qkv):
            return self._stop(f"attention {n.name} is not split over heads")
        self.sharded[n] = 1
        return True

    def _operands_agree(self, n: fx.Node, dim: int, out: Optional[tuple]) -> bool:
        """Each replicated tensor operand broadcasts over the sharded dim, or is pulled into the group."""
        if out is None or match.op_name(n) == "type_as":   # type_as reads only the other's dtype
            return True
        need = []
        for a in n.all_input_nodes:
            s = shape_of(a)
            if a in self.sharded or s is None or s == (0,):
                continue
            k = dim - (len(out) - len(s))
            if 0 <= k < len(s) and not same(s[k], 1):
                need.append(a)
            elif not self._broadcast_ok(n, a, dim):
                return False
        return self._pull(need, n) if need else True

    def _broadcast_ok(self, n: fx.Node, a: fx.Node, dim: int) -> bool:
        """A replicated operand broadcast over the shards gets a partial gradient on each rank:
        fine for parameters alone (`weight`, `1 + weight`; their module then takes its input as a
        shard and DTensor sums the gradient), wrong for an activation."""
        v = node_value(a)
        if not (isinstance(v, torch.Tensor) and v.requires_grad):
            return True
        if not param_only(a):
            return self._stop(f"{n.name} combines the sharded features with {a.name}, a replicated activation "
                              f"whose gradient would be partial on each rank")
        for p in match.inputs_closure([a]):
            pv = node_value(p)
            if p.op == "placeholder" and isinstance(pv, torch.Tensor) and pv.requires_grad:
                self.group.params[p] = dim
        return True

    def _pull(self, nodes: list, at: fx.Node) -> bool:
        for a in nodes:
            src = _source_linear(a, self.linears)
            if src is None:
                return self._stop(f"{at.name} combines the sharded features with {a.name}, which no "
                                  f"column-parallel linear produces")
            self.pull.append(src)
        return False

    def _note_heads(self, n: fx.Node, src: fx.Node, dim: int) -> None:
        out = shape_of(n)
        if match.op_name(n) in _VIEWS and out is not None and dim == len(out) - 2:
            lin = next((k for k in _back_to_linears(src, self.linears)), None)
            if lin is not None and self.linears[lin] in self.group.widths:
                try:
                    self.group.heads[self.linears[lin]] = int(out[dim])
                except TypeError:
                    pass

    def _stop(self, why: str) -> bool:
        self.fail = self.fail or why
        return False


def _back_to_linears(n: fx.Node, linears: dict) -> list[fx.Node]:
    """Linears reached walking up from `n` through single-tensor feature-keeping ops."""
    out, todo, seen = [], [n], set()
    while todo:
        x = todo.pop()
        if x in seen or not isinstance(x, fx.Node):
            continue
        seen.add(x)
        if x in linears:
            out.append(x)
            continue
        name = match.op_name(x)
        if x.op in ("placeholder", "get_attr") or not (name in _SAME or name in _VIEWS
                                                         or name in ("transpose", "permute", "getitem")):
            continue
        todo.extend(x.all_input_nodes)
    return out


def param_only(n: fx.Node) -> bool:
    """`n` is computed from parameters and constants alone (`1 + weight`)."""
    return all(is_param(x) for x in match.inputs_closure([n]) if x.op == "placeholder")


def _source_linear(n: fx.Node, linears: dict) -> Optional[fx.Node]:
    """The one linear (an nn.Linear's) that produces `n` through feature-keeping ops, else None."""
    found = [x for x in _back_to_linears(n, linears) if linears[x] is not None]
    return found[0] if len(found) == 1 else None


def infer_tp_plan(gm: fx.GraphModule, example_inputs: list, model: torch.nn.Module,
                  head_fqn: Optional[str] = None, head_loss: bool = False) -> TPPlan:
    """The plan for one captured graph: groups found by following each linear's sharded output;
    the LM head (`head_fqn`, from the regions) is column-parallel, vocab-parallel into its loss
    when `head_loss` (the graph computes one), else with its logits gathered."""
    values = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs))
    names = param_names(values, model)
    linears, owner = linear_modules(gm, values, names, model)
    head = next((n for n, f in owner.items() if f.split(" ")[0] == head_fqn), None)
    styles: dict[str, str] = {}
    replicated: dict[str, str] = {}
    groups: list[Group] = []
    done: set[fx.Node] = set()
    for lin in linears:
        if lin in done or lin is head:
            continue
        group, members, why = _grow(lin, linears, head)
        done |= members
        inner = {}
        if why is None:
            inner, why = _inner_params(gm, group, names)
        if why is not None:
            for m in members:
                replicated.setdefault(owner[m], why)
            continue
        groups.append(group)
        styles.update(inner)
        styles.update({f: "colwise" for f in group.colwise})
        styles.update({f: "rowwise" for f in group.rowwise})
    if head is not None:
        tied = _tied(model, owner[head])
        if linears.get(head) and not tied:
            styles[linears[head]] = "colwise_vocab_parallel" if head_loss else "colwise_gather_output"
        else:
            replicated[owner[head]] = tied or "its weight is not an nn.Linear's"
        if owner[head] in [f for f, st in styles.items() if st.startswith("colwise")]:
            styles.update(_vocab_embedding(gm, model))
    return TPPlan(styles, groups, {k: v for k, v in replicated.items() if k not in styles})


def param_names(values: dict, model: torch.nn.Module) -> dict[fx.Node, str]:
    """Placeholder -> the parameter's name in `model` (Dynamo lifts parameters as graph inputs)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return {ph: names[id(t)] for ph, t in values.items() if id(t) in names}


def _inner_params(gm: fx.GraphModule, group: Group, names: dict) -> tuple[dict[str, str], Optional[str]]:
    """A replicated parameter read inside the sharded region (a per-head q/k norm's weight) gets a
    partial gradient on each rank: its module takes its input as a shard ("sharded_input:dim", a
    DTensor SequenceParallel on that dim), so DTensor sums the gradient. That needs every op of
    the module to lie inside the region; otherwise the group stays replicated."""
    styles = {}
    for ph, dim in group.params.items():
        name = names.get(ph)
        if name is None:
            return {}, f"it reads {ph.name} inside the sharded region, which is no parameter of the model"
        mod = name.rsplit(".", 1)[0]
        ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
               and (module_paths(n) or [""])[-1] == mod]
        if not ops or any(n not in group.region and not param_only(n) for n in ops):
            return {}, f"its sharded features meet {name} in {mod}, which also computes outside them"
        styles[mod] = f"sharded_input:{dim}"
    return styles, None


def _vocab_embedding(gm: fx.GraphModule, model: torch.nn.Module) -> dict[str, str]:
    """Where the LM head is split by vocabulary, the token embedding is too ("rowwise_embedding":
    each rank looks up the rows it holds, the outputs summed): an nn.Embedding the graph looks
    tokens up in whose weight no other module shares."""
    mods = dict(model.named_modules())
    for n in gm.graph.nodes:
        if match.op_name(n) == "embedding" and any(is_param(a) for a in n.all_input_nodes):
            path = (module_paths(n) or [""])[-1]
            if isinstance(mods.get(path), torch.nn.Embedding) and _tied(model, path) is None:
                return {path: "rowwise_embedding"}
    return {}


def _tied(model: torch.nn.Module, fqn: str) -> Optional[str]:
    """Why the head's weight cannot be sharded alone: another module shares it (tied embeddings)."""
    mods = dict(model.named_modules())
    w = getattr(mods.get(fqn), "weight", None)
    shared = [n for n, p in model.named_parameters(remove_duplicate=False) if p is w and not n.startswith(fqn + ".")]
    return f"its weight is tied to {shared[0]} (sharding one would untie them)" if shared else None


def _grow(start: fx.Node, linears: dict, head: Optional[fx.Node], max_rounds: int = 16):
    """Propagate from `start`, taking in linears the group pulls, until it is closed."""
    if linears[start] is None:
        return None, {start}, "its weight is not an nn.Linear's (DTensor shards nn.Linear only)"
    starts = [start]
    for _ in range(max_rounds):
        prop = _Propagation(linears)
        prop.run(starts)
        members = set(starts) | {n for n in linears if linears[n] in prop.group.rowwise}
        if prop.fail is not None:
            return None, set(starts), prop.fail
        new = [p for p in prop.pull if p not in starts]
        if new:
            if any(p is head or linears[p] is None for p in new):
                return None, set(starts) | set(new), "it is combined with a linear that cannot be split"
            starts += new
            continue
        if not prop.group.rowwise:
            return None, set(starts), "its output never reaches a linear that contracts it (a router or an output)"
        prop.group.region = set(prop.sharded)
        return prop.group, members, None
    return None, set(starts), f"the group did not close in {max_rounds} rounds"
