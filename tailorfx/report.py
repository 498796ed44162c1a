"""opt.report(): what was captured, what each pass rewrote, and the predicted peak it left."""
from __future__ import annotations

import io
from typing import Optional

from rich.console import Console
from rich.table import Table

from tailorfx.budget import Budget, format_bytes


class Report:
    """A readable report (rich tables); str() gives plain text, rich renders it in colour."""

    def __init__(self, session, budget: Optional[Budget], eager_reason: Optional[str], predict=None, limit=None,
                 outputs_held: bool = True):
        self.session = session
        self.outputs_held = outputs_held   # the predictions' loop holds the model's output through backward
        self.budget = budget
        self.eager_reason = eager_reason
        self.predict = predict   # (seq_len, rewritten) -> MemoryEstimate
        self.limit = limit       # () -> (Bound at the last length, longest length the bound fits) or None

    def tables(self) -> list:
        out = []
        plan = getattr(self.session, "parallel", None)
        if plan is not None:
            spec = plan.report.spec
            how = "the step graph cut into stages" if spec.pp > 1 else "plan read off the graph; eager execution"
            t = Table(title=f"Parallel: tp={spec.tp}, dp={spec.dp}, pp={spec.pp} ({how})")
            for col in ("module", "style"):
                t.add_column(col)
            for fqn, style in plan.report.describe():
                t.add_row(fqn, style)
            out.append(t)
            if not self.session.graphs:    # nothing went through the single-device passes
                return out
        regions = Table(title="Regions found", show_lines=False)
        for col in ("graph", "kind", "module", "nodes", "token-wise"):
            regions.add_column(col)
        for g in self.session.graphs:
            for r in g.regions.regions:
                regions.add_row(str(g.index), r.kind, r.path, str(len(r.nodes)),
                                "yes" if r.token_wise else "no")
        out.append(regions)
        passes = Table(title="Passes")
        for col in ("graph", "pass", "changed", "regions rewritten", "peak before", "peak after", "time"):
            passes.add_column(col)
        for g in self.session.graphs:
            if not g.records:
                passes.add_row(str(g.index), "(none)", "-", "-", "-", "-", "-")
            for r in g.records:
                touched = ", ".join(r.touched) or "-"
                passes.add_row(str(g.index), r.name, "yes" if r.changed else "no", touched,
                               _fmt(r.peak_before), _fmt(r.peak_after), f"{r.seconds:.2f}s")
        out.append(passes)
        kernels = [(g.index, path, st["spec"], st["kernel"]) for g in self.session.graphs for r in g.records
                   if r.name == "attention" for path, st in r.stats.items() if isinstance(st, dict) and "kernel" in st]
        if kernels:
            t = Table(title="Attention: what runs each rewritten attention")
            for col in ("graph", "region", "spec", "kernel (and why)"):
                t.add_column(col)
            for row in kernels:
                t.add_row(str(row[0]), *row[1:])
            out.append(t)
        mem = self._memory_table()
        if mem is not None:
            out.append(mem)
        notes = [(g.index, r.name, f"{path}: {st['note']}") for g in self.session.graphs for r in g.records
                 for path, st in r.stats.items() if isinstance(st, dict) and st.get("note")]
        if notes:
            t = Table(title="What the rewritten model returns differently")
            for col in ("graph", "pass", "region: note"):
                t.add_column(col)
            for row in notes:
                t.add_row(str(row[0]), row[1], row[2])
            out.append(t)
        skipped = [(g.index, r.name, s) for g in self.session.graphs for r in g.records for s in r.skipped]
        if skipped:
            t = Table(title="Regions left unchanged")
            for col in ("graph", "pass", "region: reason"):
                t.add_column(col)
            for i, name, s in skipped:
                t.add_row(str(i), name, s)
            out.append(t)
        return out

    def _estimates(self):
        S = self.session.seq_len
        if self.predict is None or not S or not self.session.graphs or self.session.graphs[0].seq.symbol is None:
            return None
        try:
            return S, self.predict(S, False), self.predict(S, True)
        except RuntimeError:   # a graph that runs as captured cannot be predicted; its warning says why
            return None

    def _memory_table(self) -> Optional[Table]:
        """The predicted peak split into the static part (held across steps) and the dynamic part."""
        est = self._estimates()
        if est is None:
            return None
        S, before, after = est
        setup = after.setup.describe() if after.setup is not None else ""
        t = Table(title=f"Predicted memory at the peak of one training step, S={S} ({setup})")
        for col in ("part", "", "as captured", "rewritten"):
            t.add_column(col)
        b, a = before.breakdown(), after.breakdown()
        for k in {**b, **a}:
            kind = "dynamic" if k in ("gradients", "activations and transients") else "static"
            t.add_row(k, kind, _fmt(b.get(k, 0)), _fmt(a.get(k, 0)))
        t.add_row("static (held across steps)", "", _fmt(before.static_bytes), _fmt(after.static_bytes))
        t.add_row("dynamic (at the peak)", "", _fmt(before.dynamic_peak_bytes), _fmt(after.dynamic_peak_bytes))
        t.add_row("peak", "", _fmt(before.peak_bytes), _fmt(after.peak_bytes))
        if after.host_bytes:
            t.add_row("host memory (offloaded checkpoints, not in the peak)", "host", _fmt(before.host_bytes),
                      _fmt(after.host_bytes))
        return t

    def lines(self) -> list[str]:
        head = [f"tailorfx: {len(self.session.graphs)} graph(s) captured"]
        if self.budget is not None:
            head.append(f"budget: {self.budget}")
        for g in self.session.graphs:
            head.append(f"graph {g.index}: lowering={g.lowering}, plan: {g.plan}, "
                        f"sequence symbol={g.seq.symbol} (S={g.seq.length})")
            if g.replaced:
                head.append(f"graph {g.index}: replaced, not run since: {g.replaced}")
            if g.peak_captured is not None:
                head.append(f"graph {g.index}: predicted peak of one step (params + forward + backward): "
                            f"{_fmt(g.peak_captured)} as captured, {_fmt(g.peak_final)} rewritten")
        est = self._estimates()
        if est is not None:
            S, before, after = est
            held = "the model's output held through backward" if self.outputs_held else "only the loss held"
            head.append(f"at the last length seen (S={S}, {held}): predicted peak {_fmt(before.peak_bytes)} as captured, "
                        f"{_fmt(after.peak_bytes)} rewritten = params {_fmt(after.param_bytes)} + "
                        f"{_fmt(after.dynamic_peak_bytes)} allocated by the step at its peak "
                        f"({after.peak_phase}, {after.peak_node}; grads {_fmt(after.grad_bytes)})"
                        + (f"; host memory {_fmt(after.host_bytes)} (offloaded checkpoints)" if after.host_bytes else ""))
        head += [f"note: {n}" for n in self.session.notes]
        warns = list(self.session.warnings) + [w for g in self.session.graphs for w in g.warnings]
        if self.eager_reason:
            warns.insert(0, self.eager_reason)
        head += [f"WARNING: {w}" for w in warns]
        limit = self.limit() if self.limit is not None and est is not None else None
        if limit is not None:
            b, longest = limit
            parts = ", ".join(f"{k} {_fmt(v)}" for k, v in b.parts.items())
            head.append(f"the limit at S={b.seq_len} ({b.kind}): no {b.kind} plan of these rewrites peaks below "
                        f"{_fmt(b.peak_bytes)} "
                        f"(static {_fmt(b.static_bytes)} + {parts}; dominated by {b.dominant}); this plan's "
                        f"peak is {est[2].peak_bytes / b.peak_bytes:.2f}x that")
            if longest is not None:
                head.append(f"the longest sequence any {b.kind} plan could fit in {self.budget}: {longest:,} tokens "
                            f"(tailorfx.sequence_bound; tailorfx.max_seq_len says how close the best plan comes)")
        return head

    def __rich_console__(self, console, options):
        for line in self.lines():
            yield line
        yield from self.tables()

    def __str__(self) -> str:
        buf = io.StringIO()
        Console(file=buf, width=140, force_terminal=False, color_system=None).print(self)
        return buf.getvalue()

    __repr__ = __str__


def _fmt(n: Optional[int]) -> str:
    return format_bytes(n) if n is not None else "-"


def plot_timeline(path: str, before, after, measured: Optional[int] = None) -> str:
    """Predicted live bytes over one step, before and after the passes, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4))
    for est, label in ((before, "predicted, as captured"), (after, "predicted, rewritten")):
        ys = [(est.static_bytes + b) / 2**20 for _, _, b in est.timeline.points]
        ax.plot(range(len(ys)), ys, label=f"{label} (peak {format_bytes(est.peak_bytes)})")
    if measured is not None:
        ax.axhline((after.static_bytes + measured) / 2**20, color="k", ls="--",
                   label=f"measured peak {format_bytes(after.static_bytes + measured)}")
    ax.set_xlabel("op (forward, then backward)")
    ax.set_ylabel("live MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
