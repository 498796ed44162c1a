"""Regions of a captured graph: transformer blocks, attention, MLP, norms, LM head + loss.

Found from `nn_module_stack` metadata and dataflow, never from class names, so any architecture
works. Each node is also classified by how it treats sequence positions:
  token  - output at position s depends only on inputs at position s (chunkable along S)
  mix    - mixes positions (attention, softmax over keys, shifts, scans)
  reduce - sums over tokens into a scalar (a loss): chunkable by summing partial results
  const  - touches no sequence-shaped tensor (parameters, RoPE tables' frequencies)
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import SeqInfo, node_value

KINDS = ("block", "attention", "mlp", "norm", "lm_head_loss")


@dataclass(frozen=True)
class Region:
    """A named set of graph nodes that a pass may rewrite as a unit."""
    kind: str                      # one of KINDS
    path: str                      # module path, e.g. "model.layers.0.mlp"
    nodes: tuple[str, ...]         # node names, in graph order
    token_wise: bool               # no node mixes sequence positions (reduce allowed for losses)
    inputs: tuple[str, ...] = ()   # activations flowing in (not parameters)
    params: tuple[str, ...] = ()   # parameter/buffer placeholders used
    outputs: tuple[str, ...] = ()  # nodes used outside the region
    note: str = ""

    def __str__(self) -> str:
        tw = "token-wise" if self.token_wise else "mixes positions"
        return f"{self.kind:<13} {self.path:<40} {len(self.nodes):>4} nodes  {tw}" + (
            f"  ({self.note})" if self.note else "")


@dataclass
class RegionMap:
    """All regions of one graph plus the per-node sequence classification."""
    regions: list[Region] = field(default_factory=list)
    node_class: dict[str, str] = field(default_factory=dict)
    left: list[str] = field(default_factory=list)     # regions no pass may take, each with the reason
    in_autocast_blocks: frozenset[str] = frozenset()  # nodes inside the model's own autocast blocks

    def of_kind(self, kind: str) -> list[Region]:
        return [r for r in self.regions if r.kind == kind]

    def counts(self) -> dict[str, int]:
        return {k: len(self.of_kind(k)) for k in KINDS}


# a submodule reached through `__dict__` (peft's wrappers: `__getattr__` forwards to the wrapped model)
_PATH_PARTS = re.compile(r"\.__dict__\['_modules'\]\['([^']+)'\]|\._modules\['([^']+)'\]|\['([^']+)'\]|\[(\d+)\]")


def normalize_path(p: str) -> str:
    """"L['self'].model.layers[0]._modules['mlp']" -> "model.layers.0.mlp" (the path
    `named_modules()` gives; also through `__dict__['_modules']`). The root module is
    `L['self']`, or `L['args'][0]` when Dynamo's frame is a decorator's wrapper around forward
    (transformers 5.24 wraps some models' forward that way)."""
    for root in ("L['self']", "L['args'][0]"):
        if p.startswith(root):
            p = p[len(root):]
            break
    p = _PATH_PARTS.sub(lambda m: "." + next(g for g in m.groups() if g), p)
    return p.strip(".")


def stack_paths(stack: Optional[dict]) -> list[str]:
    """The model's module paths in an nn_module_stack, outermost first (root excluded); a module
    reached through a global inside the model's is no submodule of it (transformers' hub-kernel
    function wrappers, such as the one `kernels` puts around apply_rotary_pos_emb) and is left out."""
    raw = [v[0] if isinstance(v, tuple) else str(v) for v in (stack or {}).values()]
    if any(not r.startswith("G[") for r in raw):   # not a model itself reached through a global
        raw = [r for r in raw if not r.startswith("G[")]
    return [p for p in map(normalize_path, raw) if p]


def module_paths(node: fx.Node) -> list[str]:
    """Module paths enclosing a node, outermost first (root excluded)."""
    return stack_paths(node.meta.get("nn_module_stack"))


def param_source(node: fx.Node) -> fx.Node:
    """`node` with float dtype casts peeled off: `W.to(bf16)` -> W (the precision pass reads fp32
    master weights through such casts)."""
    while (node.op == "call_method" and node.target in match.FLOAT_CASTS and node.args
           and isinstance(node.args[0], fx.Node) and isinstance(v := node_value(node), torch.Tensor)
           and v.is_floating_point() and isinstance(s := node_value(node.args[0]), torch.Tensor)
           and s.is_floating_point() and s.shape == v.shape):
        node = node.args[0]
    return node


def is_param(node: fx.Node, through_casts: bool = False) -> bool:
    """A placeholder that carries a parameter or buffer (Dynamo lifts them as graph inputs);
    with `through_casts`, also a float cast of one (a low-precision copy of a master weight)."""
    if through_casts:
        node = param_source(node)
    if node.op == "get_attr":
        return True
    if node.op != "placeholder":
        return False
    v = node_value(node)
    return isinstance(v, torch.nn.Parameter) or "_parameters_" in node.name or "_buffers_" in node.name


def classify(node: fx.Node, seq: SeqInfo) -> str:
    """token | mix | reduce | const, see the module docstring."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return "const"
    ins = match.tensors_in((node.args, node.kwargs))
    outs = match.tensors_in(node_value(node))
    in_dims = [seq.dims(t) for t in ins]
    out_dims = [seq.dims(t) for t in outs]
    if not any(in_dims) and not any(out_dims):
        return "const"
    name = match.op_name(node)
    if name in match.ATTENTION_OPS or any(len(d) >= 2 for d in in_dims + out_dims):
        return "mix"
    if any(in_dims) and outs and not any(out_dims):
        return "reduce" if all(t.dim() == 0 for t in outs) else "mix"
    first_dims = next((d for d in in_dims if d), ())
    if name in match.DIM_OPS and ins:
        d = match.dim_arg(node)
        nd = ins[0].dim()
        dims = d if isinstance(d, (list, tuple)) else [d]
        if d is None and name not in ("cat", "concat"):
            return "mix" if name not in ("chunk", "split", "tensor_split") else "token"
        if d is None:
            d, dims = 0, [0]
        if any(isinstance(x, int) and (x % nd if nd else 0) in first_dims for x in dims):
            return "mix"
    if match.is_getitem(node) and isinstance(node.args[0], fx.Node) and ins:
        idx = match.getitem_dims(node.args[1], ins[0].dim())
        if any(dim in first_dims and not match.is_full_slice(i) for dim, i in idx.items()):
            return "mix"
    if name == "pad" and ins:
        pads = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad", ())
        nd = ins[0].dim()
        padded = {nd - 1 - i // 2 for i, v in enumerate(pads) if v}
        if padded & set(first_dims):
            return "mix"
    if name in ("conv1d", "conv2d", "conv_transpose1d", "convolution") and ins and any(
            dim >= 2 for dim in first_dims):
        return "mix"
    return "token"


def _block_paths(nodes: list[fx.Node], cls: dict[str, str]) -> list[str]:
    """Paths of repeated modules (children of a ModuleList) that contain position-mixing nodes."""
    by_parent: dict[str, set[str]] = defaultdict(set)
    for n in nodes:
        if cls.get(n.name) != "mix":
            continue
        for p in module_paths(n):
            head, _, last = p.rpartition(".")
            if last.isdigit():
                by_parent[head].add(p)
                break
    if not by_parent:
        return []
    parent = max(by_parent, key=lambda k: len(by_parent[k]))
    return sorted(by_parent[parent], key=lambda p: int(p.rpartition(".")[2]))


def _child_of(path: str, node: fx.Node) -> Optional[str]:
    """The module path one level below `path` that encloses node, if any."""
    for p in module_paths(node):
        if p.startswith(path + ".") and "." not in p[len(path) + 1:]:
            return p
    return None


def _attention_child(block: str, members: list[fx.Node], cls: dict[str, str], seq: SeqInfo) -> Optional[str]:
    """The child of a block that attends: the one holding an attention kernel or an S x S score
    matmul; failing that, the only child that mixes positions. An MoE block's router also mixes
    positions (it dispatches tokens to experts), so "the only mixing child" alone is not enough."""
    def attends(n):
        if match.op_name(n) in match.ATTENTION_OPS:
            return True
        return match.op_name(n) in match.MATMUL_OPS and any(len(seq.dims(t)) >= 2 for t in match.tensors_in(node_value(n)))
    for candidates in ({_child_of(block, n) for n in members if attends(n)},
                       {_child_of(block, n) for n in members if cls[n.name] == "mix"}):
        if len(candidates) == 1 and None not in candidates:
            return next(iter(candidates))
        if candidates:
            return None
    return None


def _make_region(kind: str, path: str, members: list[fx.Node], cls: dict[str, str],
                 allow_reduce: bool = False, note: str = "") -> Region:
    member_set = set(members)
    params: list[str] = []
    inputs: list[str] = []
    for n in members:
        for a in n.all_input_nodes:
            if a in member_set:
                continue
            target = params if is_param(a) else inputs
            if a.name not in target and isinstance(node_value(a), torch.Tensor):
                target.append(a.name)
    outputs = [n.name for n in members if any(u not in member_set for u in n.users)]
    ok = {"token", "const"} | ({"reduce"} if allow_reduce else set())
    token_wise = all(cls.get(n.name, "const") in ok for n in members)
    return Region(kind, path, tuple(n.name for n in members), token_wise,
                  tuple(inputs), tuple(params), tuple(outputs), note)


def _is_norm_module(members: list[fx.Node]) -> bool:
    names = {match.op_name(n) for n in members}
    if names & match.MATMUL_OPS or names & match.ATTENTION_OPS:
        return False
    return bool(names & match.NORM_OPS) or bool(names & match.STAT_OPS)


def find_regions(gm: fx.GraphModule, seq: SeqInfo) -> RegionMap:
    """Classify every node and group nodes into regions (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    cls = {n.name: classify(n, seq) for n in nodes}
    by_path: dict[str, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            for p in module_paths(n):
                by_path[p].append(n)
    rmap = RegionMap(node_class=cls, in_autocast_blocks=autocast_block_nodes(gm))
    blocks = _block_paths(nodes, cls)
    for b in blocks:
        members = by_path[b]
        rmap.regions.append(_make_region("block", b, members, cls))
        attn = _attention_child(b, members, cls, seq)
        if attn is not None:
            rmap.regions.append(_make_region("attention", attn, by_path[attn], cls))
        children = sorted({c for n in members if (c := _child_of(b, n)) and c != attn})
        for c in children:
            kids = by_path[c]
            num_mm = sum(match.op_name(n) in match.MATMUL_OPS for n in kids)
            if num_mm >= 2:
                rmap.regions.append(_make_region("mlp", c, kids, cls))
    for p, members in sorted(by_path.items()):
        innermost = [n for n in members if module_paths(n)[-1] == p]
        if innermost and len(innermost) == len(members) and _is_norm_module(members):
            rmap.regions.append(_make_region("norm", p, members, cls))
    head = _lm_head_loss(nodes, cls, set(blocks))
    if head is not None:
        rmap.regions.append(head)
    _leave_autocast_blocks(rmap)
    order = {k: i for i, k in enumerate(KINDS)}
    rmap.regions.sort(key=lambda r: (order[r.kind], _path_key(r.path)))
    return rmap


@dataclass(frozen=True)
class Segment:
    """A token-wise part of a block between the ops that mix positions (attention): convex (no
    path leaves it and comes back), so it can run as one op, chunk by chunk along the sequence."""
    block: str
    nodes: tuple[str, ...]         # graph order
    inputs: tuple[str, ...]        # tensors flowing in (activations, tables), not parameters
    params: tuple[str, ...]
    outputs: tuple[str, ...]       # nodes used outside the segment


def autocast_block_nodes(gm: fx.GraphModule) -> frozenset[str]:
    """Names of the nodes inside a `torch.autocast` block of the model's own forward, its entry and
    exit included (Dynamo captures them as calls: the ops between run under that block's state)."""
    inside, open_blocks = set(), []
    for n in gm.graph.nodes:
        role = compat.autocast_context_role(n.target) if n.op == "call_function" else None
        if role == "enter":
            open_blocks.append(n)
        if open_blocks:
            inside.add(n.name)
        if role == "exit" and n.args and n.args[0] in open_blocks:
            open_blocks.remove(n.args[0])
    return frozenset(inside)


def _leave_autocast_blocks(rmap: RegionMap) -> None:
    """Drop the regions (but blocks, which recompute reruns inside the graph) with a node inside an
    autocast block: a region run apart, chunk by chunk or as a kernel, would leave the block's state
    behind (its ops under the autocast around it)."""
    inside = rmap.in_autocast_blocks
    for r in [r for r in rmap.regions if r.kind != "block" and inside.intersection(r.nodes)]:
        rmap.regions.remove(r)
        rmap.left.append(f"{r.kind} {r.path} left as captured: part of it runs inside an autocast block of the "
                         f"model's own (torch.autocast in its forward), whose state a region run apart would lose")


def token_segments(gm: fx.GraphModule, block: Region, regions: RegionMap) -> list[Segment]:
    """The block's maximal token-wise segments. Nodes are grouped by how many position-mixing ops
    precede them inside the block (every path from a segment back into it would cross one), then
    by dataflow; ops that draw random numbers end a segment (a chunk recomputed in backward would
    draw again). Sequence-free ops used only inside a segment (a constant's reshape) join it. A
    segment with a node inside an autocast block of the model's own is none (find_regions)."""
    cls = regions.node_class
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inside = set(block.nodes)
    members = [n for n in nodes if n.name in inside]
    stage: dict[fx.Node, int] = {}
    for n in members:
        stage[n] = max((stage[a] + (cls.get(a.name) == "mix") for a in n.all_input_nodes if a in stage), default=0)
    token = [n for n in members if cls.get(n.name) == "token" and not match.draws_random(n)]
    parent = {n: n for n in token}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n
    for n in token:
        for a in n.all_input_nodes:
            if a in parent and stage[a] == stage[n]:
                parent[find(a)] = find(n)
    groups: dict[fx.Node, set] = defaultdict(set)
    for n in token:
        groups[find(n)].add(n)
    for n in reversed(members):   # sequence-free helpers feeding one segment only
        if cls.get(n.name) == "const" and n.op != "placeholder" and n.users:
            owners = {find(u) if u in parent else None for u in n.users}
            if len(owners) == 1 and None not in owners:
                parent[n] = next(iter(owners))
                groups[parent[n]].add(n)
    out = []
    for group in groups.values():
        seg = sorted(group, key=order.__getitem__)
        if not _convex(seg, order) or regions.in_autocast_blocks.intersection(n.name for n in seg):
            continue
        params, inputs = [], []
        for n in seg:
            for a in n.all_input_nodes:
                if a not in group and isinstance(node_value(a), torch.Tensor):
                    target = params if is_param(a) else inputs
                    if a.name not in target:
                        target.append(a.name)
        outputs = tuple(n.name for n in seg if any(u not in group for u in n.users))
        if outputs:
            out.append(Segment(block.path, tuple(n.name for n in seg), tuple(inputs), tuple(params), outputs))
    first = {n.name: order[n] for n in members}
    return sorted(out, key=lambda s: first[s.nodes[0]])


def token_producers(inputs: list[fx.Node], cls: dict[str, str], seq: SeqInfo, blocked: set) -> list[fx.Node]:
    """The model-level token-wise ops feeding a segment's `inputs` that a chunk could run itself:
    each maps a tensor along the sequence to one (a rotary table from the positions), takes no
    weight that trains and draws nothing random, and sits in no block (`blocked`). Ops that create
    the sequence dim (arange) stay outside: a chunk would number its positions from 0."""
    def maps_sequence(p: fx.Node) -> bool:
        v = node_value(p)
        return (p.op in ("call_function", "call_method") and p not in blocked and cls.get(p.name) == "token"
                and not match.draws_random(p) and isinstance(v, torch.Tensor) and len(seq.dims(v)) == 1
                and any(len(seq.dims(t)) == 1 for t in match.tensors_in((p.args, p.kwargs)))
                and not any(is_param(a) and getattr(node_value(a), "requires_grad", False) for a in p.all_input_nodes))
    chain: set[fx.Node] = set()
    stack = list(inputs)
    while stack:
        p = stack.pop()
        if p not in chain and maps_sequence(p):
            chain.add(p)
            stack.extend(p.all_input_nodes)
    return list(chain)


def _convex(seg: list[fx.Node], order: dict) -> bool:
    """No node outside `seg` is both fed by it and feeds it."""
    group, last = set(seg), max(order[n] for n in seg)
    seen, stack = set(), [u for n in seg for u in n.users if u not in group]
    while stack:
        n = stack.pop()
        if n in seen or order[n] > last:
            continue
        seen.add(n)
        for u in n.users:
            if u in group:
                return False
            stack.append(u)
    return True


def _path_key(p: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in p.split("."))


def is_weight_matmul(n: fx.Node) -> bool:
    """A matmul (linear, addmm, grouped expert mm, ...) with a parameter (or its cast) as operand."""
    return match.op_name(n) in match.MATMUL_OPS and any(is_param(a, through_casts=True) for a in n.all_input_nodes)


def _widens(mm: fx.Node) -> bool:
    """The matmul's output rows are wider than its input rows (a head maps hidden -> vocab)."""
    k = 1 if match.op_name(mm) in ("addmm", "baddbmm") else 0   # (bias, input, weight)
    src = mm.args[k] if len(mm.args) > k else None
    out, inp = node_value(mm), node_value(src) if isinstance(src, fx.Node) else None
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor) or not out.dim() or not inp.dim():
        return True
    try:
        return bool(out.shape[-1] > inp.shape[-1])
    except Exception:   # symbolic widths: cannot tell, keep the candidate
        return True


def _lm_head_loss(nodes: list[fx.Node], cls: dict[str, str], blocks: set[str]) -> Optional[Region]:
    """The last matmul outside every block with the widest output, plus the loss after it. A
    matmul whose output feeds another weight matmul, or is no wider than its input (vocab >
    hidden), is a layer inside the model, not its head."""
    def in_block(n):
        return any(p in blocks for p in module_paths(n))
    cands = [n for n in nodes if is_weight_matmul(n) and not in_block(n)
             and _widens(n) and not any(is_weight_matmul(u) for u in match.users_closure(n.users))]
    if not cands:
        return None
    width = lambda n: int(node_value(n).shape[-1]) if isinstance(node_value(n), torch.Tensor) else 0
    head = max(reversed(cands), key=width)
    down = [n for n in match.users_closure([head]) if n.op != "output" and not in_block(n)]
    has_loss = any(match.op_name(n) in match.LOSS_OPS or cls.get(n.name) == "reduce" for n in down)
    paths = module_paths(head)
    path = paths[-1] if paths else head.name
    note = "" if has_loss else "no loss in graph (logits only)"
    return _make_region("lm_head_loss", path, down, cls, allow_reduce=True, note=note)
