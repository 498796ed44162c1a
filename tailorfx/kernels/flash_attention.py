"""Flash attention, forward and backward, with the runtime's mask patterns baked in per spec.

Shapes as in `tailorfx.runtime.attention_kernels`: q (B, H, S, D); k, v (B, H_kv, S, D) with
H % H_kv == 0 (GQA/MQA: query head h reads kv head h // (H // H_kv), K/V are never repeated);
document_ids (B, S) int, a query attends only keys of its own document. Outputs: out (B, H, S, D)
in q's dtype and lse (B, H, S) fp32 (-inf for a row that may attend no key; its out is 0).

Spec (every value a compile-time constant of the rendered source):
    dtype       "fp32" | "fp16" | "bf16"
    head_dim    D (the block is the next power of two >= 16, columns past D are masked)
    mask        "full" | "window" | "bigbird" | "dilated"
    causal      bool, combined with every mask
    documents   bool: whether a document_ids argument is read
    group       H // H_kv (1: MHA)
    softcap     optional float: scores = softcap * tanh(scores / softcap) before masking
    block_m, block_n   query and key tiles of attn_fwd
    dq_block_m, dq_block_n     query and key tiles of attn_bwd_dq (default: block_m, block_n)
    bwd_block_m, bwd_block_n   query and key tiles of attn_bwd_dkdv (default: block_m, block_n)
    (a GPU launch chooses them per kernel by measurement: `flash_tiles`)
    bigbird_block      BigBird's block size (mask "bigbird" only)
    precision   optional, fp32/bf16 only: the fp32 dots' input_precision (default below)

Mask semantics are exactly `Pattern(...).element_mask` of `tailorfx.runtime.attention_tiles`:
    window (w, g): allowed if (causal: k > q - w, else |k - q| < w) or q < g or k < g
    bigbird (block, window, num_global, num_random, seed): the Pattern's block rows (host-built
        tables list the key tiles a query tile touches; the others are never loaded)
    dilated (segments, rates): LongNet as `tailorfx::dilated_attention` computes it: per branch
        (w, r), head h takes offset o = h % r and the positions start + o, start + o + r, ...
        of each segment [start, start + w) attend each other; one launch per branch merges into
        fp32 out/lse accumulators through the lse (the backward uses the merged out and lse).
Causal and window loops skip fully masked key tiles by their bounds, BigBird by its tables,
dilated attention by loading only the strided positions of a branch. A full mask's key loop is
split: interior tiles (wholly before the query tile's first row if causal, wholly in range) run
with no positional mask and unmasked loads, the diagonal and the last tile with them.

Numerics: scores, softmax and accumulators are fp32. fp32 specs run their dots as IEEE fp32
(FMAs: exact, and at the small tiles they need fewer registers than tf32x3's split operands);
bf16 specs compiled for a GPU (`precision=None`, what `spec_for` picks outside the interpreter)
and fp16 specs feed 16-bit operands to the dots (P and dS rounded to 16 bits, as FA2); under
Triton's interpreter, which computes bf16 on raw bits, bf16 specs convert to fp32 right after
loading and use tf32 dots, exact on bf16 operands (P and dS rounded to tf32). Outputs are rounded
to the input dtype once, on store.
The backward is flash-style: a preprocess computes delta = rowsum(dout * out), one kernel
recomputes P per query tile for dq, one per key tile for dk and dv, looping over the query heads
that share the kv head, so GQA gradients are summed in fp32 inside the kernel. With KV_SPLIT > 1
(a constexpr launch argument; 1 compiles the serial loop) that many programs share a kv head's
query heads, each storing its fp32 part of dk and dv at part x (B x H_kv x S x D) in buffers the
host sums: more programs where one per kv head leaves the GPU's SMs idle.
"""
# length: one kernel template: the forward, dq and dk/dv kernels render from shared mask, key-loop and
# soft-cap pieces for every spec (the launch code is flash_launch.py).
from __future__ import annotations

from string import Template

from tailorfx.kernels import POINTER_TYPES, KernelSpec

MODES = ("full", "window", "bigbird", "dilated")

# ---------------------------------------------------------------------------------------------
# Templates. `${...}` holes are filled per spec; lines a spec does not need are left out.

_HEADER = '''"""tailorfx generated: ${name}"""
import triton
import triton.language as tl

HEAD_DIM = tl.constexpr(${head_dim})
BLOCK_D = tl.constexpr(${block_d})
BLOCK_M = tl.constexpr(${block_m})
BLOCK_N = tl.constexpr(${block_n})
DQ_BLOCK_M = tl.constexpr(${dq_block_m})
DQ_BLOCK_N = tl.constexpr(${dq_block_n})
BWD_BLOCK_M = tl.constexpr(${bwd_block_m})
BWD_BLOCK_N = tl.constexpr(${bwd_block_n})
GROUP = tl.constexpr(${group})
LOG2E = tl.constexpr(1.4426950408889634)
${extra_constants}'''

_PREPROCESS = '''

@triton.jit
def attn_bwd_preprocess(out_ptr, do_ptr, delta_ptr, n_rows):
    # delta = rowsum(dout * out) over the rows of (B * H * S, D)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n_rows
    ptrs = offs_m.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(out_ptr + ptrs, mask=row_ok[:, None]${dmask}, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + ptrs, mask=row_ok[:, None]${dmask}, other=0.0).to(tl.float32)
    tl.store(delta_ptr + offs_m, tl.sum(o * do, axis=1), mask=row_ok)
'''


def _block(text: str, indent: int) -> str:
    """Dedented lines of `text` re-indented by `indent` spaces (blank lines dropped)."""
    lines = [ln for ln in text.strip("\n").splitlines() if ln.strip()]
    pad = min(len(ln) - len(ln.lstrip()) for ln in lines)
    return "\n".join(" " * indent + ln[pad:] for ln in lines)


class Config:
    """A spec's values, validated, and the source fragments they select."""

    def __init__(self, spec):
        self.spec = spec
        self.dtype = spec.get("dtype", "fp32")
        if self.dtype not in POINTER_TYPES:
            raise ValueError(f"flash_attention dtype {self.dtype!r}: one of {list(POINTER_TYPES)}")
        self.mode = spec.get("mask", "full")
        if self.mode not in MODES:
            raise ValueError(f"flash_attention mask {self.mode!r}: one of {list(MODES)}")
        self.head_dim = int(spec["head_dim"])
        self.block_d = max(16, 1 << (self.head_dim - 1).bit_length())
        self.block_m, self.block_n = int(spec["block_m"]), int(spec["block_n"])
        self.dq_block_m = int(spec.get("dq_block_m", self.block_m))
        self.dq_block_n = int(spec.get("dq_block_n", self.block_n))
        self.bwd_block_m = int(spec.get("bwd_block_m", self.block_m))
        self.bwd_block_n = int(spec.get("bwd_block_n", self.block_n))
        tiles = (self.block_m, self.block_n, self.dq_block_m, self.dq_block_n, self.bwd_block_m, self.bwd_block_n)
        for name, b in zip(("block_m", "block_n", "dq_block_m", "dq_block_n", "bwd_block_m", "bwd_block_n"), tiles):
            if b < 16 or b & (b - 1):
                raise ValueError(f"flash_attention {name}={b}: a power of two >= 16 (tl.dot)")
        self.group = int(spec.get("group", 1))
        if self.group < 1:
            raise ValueError(f"flash_attention group={self.group}")
        self.causal = bool(spec.get("causal", False))
        self.documents = bool(spec.get("documents", False))
        self.key_bias = bool(spec.get("key_bias", False))
        self.softcap = spec.get("softcap")
        if self.softcap is not None and not float(self.softcap) > 0:
            raise ValueError(f"flash_attention softcap={self.softcap}: a positive float (or leave it out)")
        self.bb_block = spec.get("bigbird_block")
        if self.mode == "bigbird":
            if not self.bb_block or int(self.bb_block) < 1:
                raise ValueError("flash_attention mask 'bigbird' needs bigbird_block >= 1")
            self.bb_block = int(self.bb_block)
        elif self.bb_block is not None:
            raise ValueError("bigbird_block is only for mask 'bigbird'")
        # BigBird blocks that are whole multiples of every tile: a listed tile is allowed in full
        self.aligned = self.mode == "bigbird" and all(self.bb_block % t == 0 for t in tiles)
        self.dilated = self.mode == "dilated"
        # fp32 dots: IEEE for fp32 inputs (FMAs: exact and, at small tiles, fewer registers than
        # tf32x3's split operands), tf32 MMAs for bf16 inputs (exact on bf16 operands)
        # bf16 with precision None: bf16 operands (P and dS rounded to bf16, as FA2), compiled only:
        # the interpreter computes bf16 on raw bits
        self.precision = spec.get("precision", {"fp32": "ieee", "bf16": "tf32", "fp16": None}[self.dtype])
        if self.dtype == "fp16" and self.precision is not None:
            raise ValueError("fp16 specs feed fp16 operands to the dots: no precision to choose")
        if self.dtype == "fp32" and self.precision is None:
            raise ValueError("fp32 specs need a dot precision: 'ieee', 'tf32x3' or 'tf32'")
        if self.precision not in (None, "tf32", "tf32x3", "ieee"):
            raise ValueError(f"flash_attention precision {self.precision!r}: 'tf32', 'tf32x3', 'ieee' or None")
        self.low = self.precision is None   # 16-bit dot operands

    # -- fragments --
    @property
    def load_cvt(self) -> str:   # bf16 into fp32 dots: fp32 after the load
        return ".to(tl.float32)" if self.dtype == "bf16" and not self.low else ""

    @property
    def dot_cast(self) -> str:   # fp32 probabilities into the dot's operand type
        return {"fp16": ".to(tl.float16)", "bf16": ".to(tl.bfloat16)"}[self.dtype] if self.low else ""

    @property
    def prec(self) -> str:
        return "" if self.low else ", input_precision=PRECISION"

    @property
    def dmask(self) -> str:
        return "" if self.block_d == self.head_dim else " & (offs_d < HEAD_DIM)[None, :]"

    def mode_args(self) -> list[str]:
        if self.mode == "window":
            return ["window", "num_global"]
        if self.mode == "bigbird":
            t = ["table_ptr", "count_ptr", "table_width"]
            return t + ([] if self.aligned else ["bm_ptr", "num_blocks"])
        if self.mode == "dilated":
            return ["segment", "rate"]
        return []

    def doc_args(self) -> list[str]:
        return (["doc_ptr"] if self.documents else []) + (["kb_ptr"] if self.key_bias else [])


def _mask_lines(c: Config, rows: str, interior: bool = False) -> str:
    """The element mask of a (rows x cols) score tile: rows are queries ("q") or keys ("k").
    An interior tile (every pair in range and causally allowed) keeps only the document mask;
    "" when nothing is masked there."""
    if rows == "q":
        Q, K, ok = "offs_m[:, None]", "offs_n[None, :]", "col_ok[None, :]"
        dq, dk = "doc_m[:, None]", "doc_n[None, :]"
    else:
        Q, K, ok = "offs_m[None, :]", "offs_n[:, None]", "col_ok[:, None] & row_ok[None, :]"
        dq, dk = "doc_m[None, :]", "doc_n[:, None]"
    if interior:
        return f"mask = {dq} == {dk}" if c.documents else ""
    lines = [f"mask = {ok}"]
    if c.causal:
        lines.append(f"mask = mask & ({K} <= {Q})")
    if c.mode == "window":
        near = f"({K} > {Q} - window)" if c.causal else f"(tl.abs({K} - {Q}) < window)"
        lines.append(f"mask = mask & ({near} | ({Q} < num_global) | ({K} < num_global))")
    if c.mode == "bigbird" and not c.aligned:
        lines.append(f"allowed = tl.load(bm_ptr + ({Q} // BB_BLOCK) * num_blocks + {K} // BB_BLOCK, mask=mask, other=0)")
        lines.append("mask = mask & (allowed != 0)")
    if c.documents:
        lines.append(f"mask = mask & ({dq} == {dk})")
    return "\n".join(lines)


def _softcap_lines(c: Config, s: str) -> str:
    if c.softcap is None:
        return ""
    # tanh(x), x = s / cap: sign(x) (1 - e^-2|x|) / (1 + e^-2|x|) through exp2 (no libdevice), and
    # its odd Taylor series below 1/8, where 1 - 2 / (e^2x + 1) loses tanh's relative accuracy
    # (an absolute error of about u: 10% of tanh at scores near 0, seen in Gemma-2's gradients)
    return "\n".join([
        f"xc = {s} / SOFTCAP",
        "axc = tl.abs(xc)",
        "ec = tl.math.exp2(axc * (-2.0 * LOG2E))",
        "tc = (1.0 - ec) / (1.0 + ec)",
        "x2c = xc * xc",
        "small = xc * (1.0 + x2c * (-0.3333333333333333 + x2c * (0.13333333333333333 + x2c * -0.05396825396825397)))",
        "t = tl.where(axc < 0.125, small, tl.where(xc < 0.0, -tc, tc))",
        f"{s} = SOFTCAP * t"])


def _key_bias_line(c: Config, s: str, interior: bool = False, factor: str = "") -> str:
    """ALiBi's per-key bias (B * H, S) fp32, added after the soft-cap as the tiles' score_mod
    "key_bias" adds it: a constant of the scores, so the backward's d scores are unchanged.
    `factor`: the bias's scale where the scores are in exp2's units (" * LOG2E")."""
    if not c.key_bias:
        return ""
    bias = "tl.load(kb_ptr + bh * seq_len + pos_n" + (")" if interior else ", mask=col_ok, other=0.0)")
    return f"{s} = {s} + {bias}[None, :]{factor}" if s == "s" else f"{s} = {s} + {bias}[:, None]{factor}"


def _scores(c: Config, s: str, dot: str, interior: bool = False) -> tuple[list[str], str]:
    """The lines making the scores `s` from `dot` (q k^T, unscaled), and the factor that takes them
    to exp2's units (log2 e x the natural scores): the softmax's exponent is then one FMA a score
    (`s * factor - max`), the Triton fused-attention tutorial's arithmetic, where nothing else needs
    the scores scaled (with a key bias they are scaled and biased in those units, one FMA; a
    soft-cap acts on natural scores, then converted, as do dilated branches, whose dk/dv head loop
    spilled registers on sm90 under Triton 3.6 the other way). The row max of unscaled scores times the
    factor is the max of the scaled ones: `scale` is positive (flash_launch checks it)."""
    if c.softcap is not None or c.dilated:   # dilated: its dk/dv's head loop spills otherwise (sm90, Triton 3.6)
        return [f"{s} = {dot} * scale", _softcap_lines(c, s), _key_bias_line(c, s, interior)], " * LOG2E"
    if c.key_bias:
        return [f"{s} = {dot} * qk_scale", _key_bias_line(c, s, interior, " * LOG2E")], ""
    return [f"{s} = {dot}"], " * qk_scale"


# Inductor passes a Python float to a user kernel typed fp64 (`config._use_fp64_for_unbacked_floats`),
# Triton's own launcher fp32: every dot and every stored value stays fp32 either way
_SCALE_FP32 = "scale = tl.cast(scale, tl.float32)"
_QK_SCALE = "qk_scale = scale * LOG2E   # natural scores to exp2's units"


def _row_prologue(c: Config, fn: str) -> str:
    """Program -> (batch, head, query rows) for attn_fwd and attn_bwd_dq."""
    out = [_SCALE_FP32, _QK_SCALE,
           "bh = tl.program_id(1)",
           "b = bh // num_heads",
           "h = bh % num_heads",
           "kv_bh = b * (num_heads // GROUP) + h // GROUP"]
    if c.dilated:
        out += ["# one dilated branch: this head's offset o = h % rate within each segment",
                "tiles_per_segment = tl.cdiv(tl.cdiv(segment, rate), BLOCK_M)",
                "seg = tl.program_id(0) // tiles_per_segment",
                "start_m = (tl.program_id(0) % tiles_per_segment) * BLOCK_M",
                "base = seg * segment + h % rate",
                "n_keys = (tl.minimum(segment, seq_len - seg * segment) - h % rate + rate - 1) // rate",
                "offs_m = start_m + tl.arange(0, BLOCK_M)",
                "pos_m = base + offs_m * rate"]
    else:
        out += ["start_m = tl.program_id(0) * BLOCK_M",
                "n_keys = seq_len",
                "offs_m = start_m + tl.arange(0, BLOCK_M)",
                "pos_m = offs_m"]
    out += ["offs_d = tl.arange(0, BLOCK_D)",
            "row_ok = offs_m < n_keys",
            "q_base = q_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM",
            "k_base = k_ptr + kv_bh.to(tl.int64) * seq_len * HEAD_DIM",
            "v_base = v_ptr + kv_bh.to(tl.int64) * seq_len * HEAD_DIM",
            "row_ptrs = pos_m[:, None] * HEAD_DIM + offs_d[None, :]",
            f"q = tl.load(q_base + row_ptrs, mask=row_ok[:, None]{c.dmask}, other=0.0){c.load_cvt}"]
    if fn == "dq":
        out += ["do = tl.load(do_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs, "
                f"mask=row_ok[:, None]{c.dmask}, other=0.0){c.load_cvt}",
                "lse = tl.load(lse_ptr + bh * seq_len + pos_m, mask=row_ok, other=float(\"inf\"))",
                "lse2 = lse * LOG2E   # in exp2's units",
                "delta = tl.load(delta_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0)"]
    if c.documents:
        out.append("doc_m = tl.load(doc_ptr + b * seq_len + pos_m, mask=row_ok, other=-1)")
    return "\n".join(out)


def _key_loops(c: Config) -> tuple[str, list[tuple[str, str, bool]]]:
    """(setup, [(loop header, first body line, interior)]) over the key tiles a query tile may
    touch. A full mask splits them: interior tiles (keys wholly before the first row if causal,
    wholly in range) run without the positional mask, the diagonal and the tail with it."""
    if c.mode == "full":
        if c.causal:
            setup = ("hi = tl.cdiv(tl.minimum(start_m + BLOCK_M, n_keys), BLOCK_N)  # causal: no tile past the last row\n"
                     "n_full = (start_m + 1) // BLOCK_N  # key tiles wholly at or before the first row")
        else:
            setup = "hi = tl.cdiv(n_keys, BLOCK_N)\nn_full = n_keys // BLOCK_N  # key tiles wholly in range"
        return setup, [("for kt in range(0, n_full):", "", True), ("for kt in range(n_full, hi):", "", False)]
    if c.mode == "dilated":
        if c.causal:
            setup = "hi = tl.cdiv(tl.minimum(start_m + BLOCK_M, n_keys), BLOCK_N)  # causal: no tile past the last row"
        else:
            setup = "hi = tl.cdiv(n_keys, BLOCK_N)"
        return setup, [("for kt in range(0, hi):", "", False)]
    if c.mode == "window":
        last = "tl.minimum(start_m + BLOCK_M, seq_len) - 1"
        if c.causal:
            hi = "hi = tl.cdiv(last_m + 1, BLOCK_N)"
            band_hi = "band_hi = hi"
        else:
            hi = "hi = tl.cdiv(seq_len, BLOCK_N)"
            band_hi = "band_hi = tl.minimum(tl.cdiv(tl.minimum(last_m + window, seq_len), BLOCK_N), hi)"
        setup = f"""
# key tiles: those holding global keys (k < num_global), then the band around the rows;
# a tile holding global queries (q < num_global) sees every key
last_m = {last}
{hi}
n_glob = tl.minimum(tl.cdiv(num_global, BLOCK_N), hi)
band_lo = tl.maximum(tl.maximum(start_m - window + 1, 0) // BLOCK_N, n_glob)
{band_hi}
everything = start_m < num_global
n_glob = tl.where(everything, 0, n_glob)
band_lo = tl.where(everything, 0, band_lo)
band_hi = tl.where(everything, hi, band_hi)
n_tiles = n_glob + tl.maximum(band_hi - band_lo, 0)"""
        return setup, [("for j in range(0, n_tiles):", "kt = j + (j >= n_glob).to(tl.int32) * (band_lo - n_glob)",
                        False)]
    # bigbird: the host's table of key tiles per query tile
    setup = """
# key tiles: the host's table of those holding an allowed pair
n_tiles = tl.load(count_ptr + tl.program_id(0))"""
    return setup, [("for j in range(0, n_tiles):", "kt = tl.load(table_ptr + tl.program_id(0) * table_width + j)", False)]


def _loops(setup: str, loops: list[tuple[str, str, bool]], body, indent: int) -> str:
    """The setup, then each loop's header and `body(interior)` under it, at `indent` spaces."""
    out = [_block(setup, indent)] if setup.strip() else []
    for header, first, interior in loops:
        out += [" " * indent + header, _block("\n".join(x for x in [first, body(interior)] if x), indent + 4)]
    return "\n".join(out)


def _key_tile_loads(c: Config, interior: bool = False) -> str:
    """Loads of a key tile's k, v (and documents); an interior tile's keys are all in range."""
    pos = "base + offs_n * rate" if c.dilated else "offs_n"
    if interior:
        kv_mask = f", mask=(offs_d < HEAD_DIM)[None, :], other=0.0" if c.dmask else ""
        doc_mask = ""
    else:
        kv_mask, doc_mask = f", mask=col_ok[:, None]{c.dmask}, other=0.0", ", mask=col_ok, other=-2"
    out = ["offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)",
           f"pos_n = {pos}",
           "" if interior else "col_ok = offs_n < n_keys",
           "col_ptrs = pos_n[:, None] * HEAD_DIM + offs_d[None, :]",
           f"k = tl.load(k_base + col_ptrs{kv_mask}){c.load_cvt}",
           f"v = tl.load(v_base + col_ptrs{kv_mask}){c.load_cvt}"]
    if c.documents:
        out.append(f"doc_n = tl.load(doc_ptr + b * seq_len + pos_n{doc_mask})")
    return "\n".join(x for x in out if x)


def _fwd(c: Config) -> str:
    args = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "lse_ptr"] + c.doc_args() + c.mode_args() + ["scale", "seq_len", "num_heads"]
    setup, loops = _key_loops(c)

    def body(interior: bool) -> str:
        mask = _mask_lines(c, "q", interior)
        scores, to_exp2 = _scores(c, "s", f"tl.dot(q, tl.trans(k){c.prec})", interior)
        if mask:   # m_i, m_new: the running max in exp2's units
            update = [mask,
                      "s = tl.where(mask, s, float(\"-inf\"))",
                      f"m_new = tl.maximum(m_i, tl.max(s, axis=1){to_exp2})",
                      "m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)  # a row with nothing allowed yet stays 0"]
        else:   # every score finite: the running max is too
            update = [f"m_new = tl.maximum(m_i, tl.max(s, axis=1){to_exp2})", "m_safe = m_new"]
        return "\n".join(x for x in [
            _key_tile_loads(c, interior),
            *scores,
            *update,
            f"p = tl.math.exp2(s{to_exp2} - m_safe[:, None])",
            "alpha = tl.math.exp2(m_i - m_safe)",
            "l_i = l_i * alpha + tl.sum(p, axis=1)",
            f"acc = acc * alpha[:, None] + tl.dot(p{c.dot_cast}, v{c.prec})",
            "m_i = m_new"] if x)
    if c.dilated:   # merge this branch into the fp32 accumulators of the branches before it
        epilogue = f"""
out_ptrs = out_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs
lse_ptrs = lse_ptr + bh * seq_len + pos_m
lse_old = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
o_old = tl.load(out_ptrs, mask=row_ok[:, None]{c.dmask}, other=0.0)
top = tl.maximum(lse_old, lse)
top_safe = tl.where(top == float("-inf"), 0.0, top)
total = tl.math.exp2((lse_old - top_safe) * LOG2E) + tl.math.exp2((lse - top_safe) * LOG2E)
new = tl.where(total == 0.0, float("-inf"), top_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
new_safe = tl.where(new == float("-inf"), 0.0, new)
o = o_old * tl.math.exp2((lse_old - new_safe) * LOG2E)[:, None] + out * tl.math.exp2((lse - new_safe) * LOG2E)[:, None]
tl.store(out_ptrs, o, mask=row_ok[:, None]{c.dmask})
tl.store(lse_ptrs, new, mask=row_ok)"""
    else:
        epilogue = f"""
tl.store(out_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None]{c.dmask})
tl.store(lse_ptr + bh * seq_len + pos_m, lse, mask=row_ok)"""
    return f'''

@triton.jit
def attn_fwd({", ".join(args)}):
{_block(_row_prologue(c, "fwd"), 4)}
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
{_loops(setup, loops, body, 4)}
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(l_safe)) / LOG2E)
{_block(epilogue, 4)}
'''


def _dq(c: Config) -> str:
    args = (["q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr"] + c.doc_args() + c.mode_args()
            + ["scale", "seq_len", "num_heads"])
    setup, loops = _key_loops(c)

    def body(interior: bool) -> str:
        mask = _mask_lines(c, "q", interior)
        scores, to_exp2 = _scores(c, "s", f"tl.dot(q, tl.trans(k){c.prec})", interior)
        if mask:   # lse2: lse in exp2's units
            p = [mask, "# lse is -inf only on rows with no allowed key, where the mask drops every p",
                 f"p = tl.where(mask, tl.math.exp2(s{to_exp2} - lse2[:, None]), 0.0)"]
        else:   # rows past the end read lse = inf: p = 0
            p = [f"p = tl.math.exp2(s{to_exp2} - lse2[:, None])"]
        return "\n".join(x for x in [
            _key_tile_loads(c, interior),
            *scores,
            *p,
            f"dp = tl.dot(do, tl.trans(v){c.prec})",
            "ds = p * (dp - delta[:, None])",
            "ds = ds * (1.0 - t * t)" if c.softcap is not None else "",
            f"dq += tl.dot(ds{c.dot_cast}, k{c.prec})"] if x)
    dq_ptrs = "dq_ptr + bh.to(tl.int64) * seq_len * HEAD_DIM + row_ptrs"
    if c.dilated:   # branches add into one fp32 dq
        store = f"""
dq_ptrs = {dq_ptrs}
dq = dq * scale + tl.load(dq_ptrs, mask=row_ok[:, None]{c.dmask}, other=0.0)
tl.store(dq_ptrs, dq, mask=row_ok[:, None]{c.dmask})"""
    else:
        store = f"tl.store({dq_ptrs}, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None]{c.dmask})"
    src = f'''

@triton.jit
def attn_bwd_dq({", ".join(args)}):
{_block(_row_prologue(c, "dq"), 4)}
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
{_loops(setup, loops, body, 4)}
{_block(store, 4)}
'''
    # dq holds dq, q and do tiles per query row: tiles of its own
    return src.replace("BLOCK_M", "DQ_BLOCK_M").replace("BLOCK_N", "DQ_BLOCK_N")


def _query_loops(c: Config) -> tuple[str, list[tuple[str, str, bool]]]:
    """(setup, [(loop header, first body line, interior)]) over the query tiles that may see a
    key tile (the setup does not depend on the head, so it runs once before the head loop). A
    full bidirectional mask needs no mask here: rows past the end read lse = inf (p = 0), and
    keys past it are never stored."""
    lo = "start_n // BLOCK_M" if c.causal else "0"
    # one loop: a second copy of the body (the diagonal's query tiles masked, those after it not) costs
    # the key tile's registers: tried again on 2026-12-07, it spilled (up to 168 B) in 7 of the 8 ptxas
    # checks under Triton 3.6 (test_triton_codegen.py)
    if c.mode == "full":
        return "", [(f"for qt in range({lo}, tl.cdiv(n_keys, BLOCK_M)):", "", not c.causal)]
    if c.dilated:   # heads of another offset run no tile (a loop with a runtime step spills)
        return "", [(f"for qt in range({lo}, tl.where(h % rate == offset, tl.cdiv(n_keys, BLOCK_M), 0)):", "",
                     False)]
    if c.mode == "window":
        hi = "band_hi = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1 + window, BLOCK_M), n_qt)"
        if c.causal:   # no global query precedes a non-global key
            setup = f"""
# query tiles: the band after the keys; a tile holding global keys is seen by every later row
n_qt = tl.cdiv(seq_len, BLOCK_M)
band_lo = start_n // BLOCK_M
{hi}
band_hi = tl.where(start_n < num_global, n_qt, band_hi)"""
            return setup, [("for qt in range(band_lo, band_hi):", "", False)]
        setup = f"""
# query tiles: those holding global queries (q < num_global), then the band around the keys;
# a tile holding global keys is seen by every row
n_qt = tl.cdiv(seq_len, BLOCK_M)
n_glob = tl.minimum(tl.cdiv(num_global, BLOCK_M), n_qt)
band_lo = tl.maximum(tl.maximum(start_n - window + 1, 0) // BLOCK_M, n_glob)
{hi}
everything = start_n < num_global
n_glob = tl.where(everything, 0, n_glob)
band_lo = tl.where(everything, 0, band_lo)
band_hi = tl.where(everything, n_qt, band_hi)
n_tiles = n_glob + tl.maximum(band_hi - band_lo, 0)"""
        return setup, [("for j in range(0, n_tiles):", "qt = j + (j >= n_glob).to(tl.int32) * (band_lo - n_glob)",
                        False)]
    setup = """
# query tiles: the host's table of those that see this key tile
n_tiles = tl.load(count_ptr + tl.program_id(0))"""
    return setup, [("for j in range(0, n_tiles):", "qt = tl.load(table_ptr + tl.program_id(0) * table_width + j)",
                    False)]


def _dkdv(c: Config) -> str:
    args = (["q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dk_ptr", "dv_ptr"] + c.doc_args()
            + c.mode_args() + ["scale", "seq_len", "num_heads"] + ([] if c.dilated else ["KV_SPLIT: tl.constexpr"]))
    pre = [_SCALE_FP32, _QK_SCALE, "num_kv = num_heads // GROUP"]
    if c.dilated:
        pre += ["# one dilated branch: this kv head's query heads with one offset (h % rate), at most",
                "# min(GROUP, rate) offsets per kv head, one program each",
                "n_off = tl.minimum(GROUP, rate)",
                "bkv = tl.program_id(1) // n_off",
                "offset = ((bkv % num_kv) * GROUP + tl.program_id(1) % n_off) % rate",
                "tiles_per_segment = tl.cdiv(tl.cdiv(segment, rate), BLOCK_N)",
                "seg = tl.program_id(0) // tiles_per_segment",
                "start_n = (tl.program_id(0) % tiles_per_segment) * BLOCK_N",
                "base = seg * segment + offset",
                "n_keys = (tl.minimum(segment, seq_len - seg * segment) - offset + rate - 1) // rate",
                "offs_n = start_n + tl.arange(0, BLOCK_N)",
                "pos_n = base + offs_n * rate"]
    else:
        pre += ["# KV_SPLIT programs share a kv head's query heads, each writing its fp32 part",
                "bkv = tl.program_id(1) // KV_SPLIT",
                "h0 = tl.program_id(1) % (num_kv * KV_SPLIT) * (GROUP // KV_SPLIT)   # its first query head",
                "start_n = tl.program_id(0) * BLOCK_N",
                "n_keys = seq_len",
                "offs_n = start_n + tl.arange(0, BLOCK_N)",
                "pos_n = offs_n"]
    heads = ("range((bkv % num_kv) * GROUP, (bkv % num_kv) * GROUP + GROUP)" if c.dilated else
             "range(h0, h0 + GROUP // KV_SPLIT)")
    pre += ["b = bkv // num_kv",
            "offs_d = tl.arange(0, BLOCK_D)",
            "col_ok = offs_n < n_keys",
            "col_ptrs = bkv.to(tl.int64) * seq_len * HEAD_DIM + pos_n[:, None] * HEAD_DIM + offs_d[None, :]",
            f"k = tl.load(k_ptr + col_ptrs, mask=col_ok[:, None]{c.dmask}, other=0.0){c.load_cvt}",
            f"v = tl.load(v_ptr + col_ptrs, mask=col_ok[:, None]{c.dmask}, other=0.0){c.load_cvt}"]
    if c.documents:
        pre.append("doc_n = tl.load(doc_ptr + b * seq_len + pos_n, mask=col_ok, other=-2)")
    pre += ["dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)",
            "dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)"]
    setup, loops = _query_loops(c)
    if setup:
        pre += setup.strip("\n").splitlines()
    pos = "base + offs_m * rate" if c.dilated else "offs_m"

    def body(interior: bool) -> str:
        mask = _mask_lines(c, "k", interior)
        scores, to_exp2 = _scores(c, "st", f"tl.dot(k, tl.trans(q){c.prec})")
        pt = f"tl.math.exp2(st{to_exp2} - lse2[None, :])"
        lse_other = 'float("inf")' if interior else "0.0"   # rows past the end: p = 0 with no mask
        return "\n".join(x for x in [
            "offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)",
            f"pos_m = {pos}",
            "row_ok = offs_m < n_keys",
            "row_ptrs = bh.to(tl.int64) * seq_len * HEAD_DIM + pos_m[:, None] * HEAD_DIM + offs_d[None, :]",
            f"q = tl.load(q_ptr + row_ptrs, mask=row_ok[:, None]{c.dmask}, other=0.0){c.load_cvt}",
            f"do = tl.load(do_ptr + row_ptrs, mask=row_ok[:, None]{c.dmask}, other=0.0){c.load_cvt}",
            f"lse2 = tl.load(lse_ptr + bh * seq_len + pos_m, mask=row_ok, other={lse_other}) * LOG2E",
            "delta = tl.load(delta_ptr + bh * seq_len + pos_m, mask=row_ok, other=0.0)",
            "doc_m = tl.load(doc_ptr + b * seq_len + pos_m, mask=row_ok, other=-1)" if c.documents else "",
            *scores,
            mask,
            f"pt = tl.where(mask, {pt}, 0.0)" if mask else f"pt = {pt}",
            f"dv += tl.dot(pt{c.dot_cast}, do{c.prec})",
            f"dpt = tl.dot(v, tl.trans(do){c.prec})",
            "dst = pt * (dpt - delta[None, :])",
            "dst = dst * (1.0 - t * t)" if c.softcap is not None else "",
            f"dk += tl.dot(dst{c.dot_cast}, q{c.prec})"] if x)
    if c.dilated:   # branches add into fp32 dk, dv (each position of a kv head has one owner per launch)
        store = f"""
dk = dk * scale + tl.load(dk_ptr + col_ptrs, mask=col_ok[:, None]{c.dmask}, other=0.0)
dv = dv + tl.load(dv_ptr + col_ptrs, mask=col_ok[:, None]{c.dmask}, other=0.0)
tl.store(dk_ptr + col_ptrs, dk, mask=col_ok[:, None]{c.dmask})
tl.store(dv_ptr + col_ptrs, dv, mask=col_ok[:, None]{c.dmask})"""
    else:
        store = f"""
part_offset = (tl.program_id(1) % KV_SPLIT).to(tl.int64) * (tl.num_programs(1) // KV_SPLIT) * seq_len * HEAD_DIM
tl.store(dk_ptr + part_offset + col_ptrs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None]{c.dmask})
tl.store(dv_ptr + part_offset + col_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None]{c.dmask})"""
    src = f'''

@triton.jit
def attn_bwd_dkdv({", ".join(args)}):
{_block(chr(10).join(pre), 4)}
    for h in {heads}:
        bh = b * num_heads + h
{_loops("", loops, body, 8)}
{_block(store, 4)}
'''
    # the key-tile kernel has tiles of its own (it holds k, v, dk and dv: four BLOCK_N x D tiles)
    return src.replace("BLOCK_M", "BWD_BLOCK_M").replace("BLOCK_N", "BWD_BLOCK_N")


def render(spec) -> str:
    c = Config(spec)
    extra = []
    if not c.low:
        extra.append(f'PRECISION = tl.constexpr("{c.precision}")')
    if c.softcap is not None:
        extra.append(f"SOFTCAP = tl.constexpr({float(c.softcap)!r})")
    if c.mode == "bigbird" and not c.aligned:
        extra.append(f"BB_BLOCK = tl.constexpr({c.bb_block})")
    head = Template(_HEADER).substitute(
        name=spec.name, head_dim=c.head_dim, block_d=c.block_d, block_m=c.block_m, block_n=c.block_n,
        dq_block_m=c.dq_block_m, dq_block_n=c.dq_block_n, bwd_block_m=c.bwd_block_m, bwd_block_n=c.bwd_block_n,
        group=c.group, extra_constants="".join(x + "\n" for x in extra))
    return (head + "\n# mask: " + _describe(c) + "\n" + _fwd(c) + Template(_PREPROCESS).substitute(dmask=c.dmask)
            + _dq(c) + _dkdv(c))


def _describe(c: Config) -> str:
    parts = [c.mode + (" (BigBird blocks cover whole tiles)" if c.aligned else ""),
             "causal" if c.causal else "non-causal"]
    if c.documents:
        parts.append("documents")
    if c.key_bias:
        parts.append("key bias")
    if c.softcap is not None:
        parts.append(f"softcap {float(c.softcap)!r}")
    return ", ".join(parts)


def signatures(spec) -> dict[str, dict[str, str]]:
    c = Config(spec)
    t = POINTER_TYPES[c.dtype]
    acc = "*fp32" if c.dilated else t   # dilated branches accumulate into fp32
    mode = {"window": "i32", "num_global": "i32", "table_ptr": "*i32", "count_ptr": "*i32", "table_width": "i32",
            "bm_ptr": "*i8", "num_blocks": "i32", "segment": "i32", "rate": "i32"}
    tail = {a: mode[a] for a in c.mode_args()}
    tail.update({"scale": "fp32", "seq_len": "i32", "num_heads": "i32"})
    doc = ({"doc_ptr": "*i32"} if c.documents else {}) | ({"kb_ptr": "*fp32"} if c.key_bias else {})
    fwd = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "out_ptr": acc, "lse_ptr": "*fp32", **doc, **tail}
    pre = {"out_ptr": t, "do_ptr": t, "delta_ptr": "*fp32", "n_rows": "i32"}
    dq = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "do_ptr": t, "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_ptr": acc,
          **doc, **tail}
    dkdv = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "do_ptr": t, "lse_ptr": "*fp32", "delta_ptr": "*fp32",
            "dk_ptr": acc, "dv_ptr": acc, **doc, **tail, **({} if c.dilated else {"KV_SPLIT": 1})}
    return {"attn_fwd": fwd, "attn_bwd_preprocess": pre, "attn_bwd_dq": dq, "attn_bwd_dkdv": dkdv}


def num_warps(spec) -> int:
    """The warps `examples()` and the interpreter launch with; a GPU launch takes its tiles' own
    (`flash_tiles`)."""
    return 4


def default_blocks(dtype: str, head_dim: int, mask: str = "full") -> tuple[int, int, int, int]:
    """(block_m, block_n, bwd_block_m, bwd_block_n) at 4 warps: the interpreter's tiles and
    `examples()`'s (attn_fwd/attn_bwd_dq, then attn_bwd_dkdv, which holds four BLOCK_N x D tiles:
    k, v, dk, dv). They compile without register spills for sm80 and sm90 in every form
    (including bf16 through fp32 dots, the interpreter's) under Triton 3.6 and 3.9; a GPU launch
    of a tuned form chooses among `flash_tiles.candidates` instead."""
    if dtype == "fp32":   # IEEE dots run on FMAs: small tiles
        return (32, 16, 16, 32) if head_dim <= 64 else (16, 16, 16, 16) if head_dim <= 128 else (32, 16, 16, 16)
    if head_dim <= 64:
        return (64, 32, 32, 16)
    return (32, 16, 16, 16) if mask == "dilated" else (32, 32, 16, 16)


def examples() -> list:
    """Representative specs: the goldens and the sm80/sm90 compile checks run over these
    (every mask, causal or not, documents, GQA, softcap, a key bias, fp32/fp16/bf16, head dims 64
    and 128, BigBird blocks covering whole tiles or not)."""

    def spec(dtype, d, mask, causal, documents=False, group=1, softcap=None, **extra):
        bm, bn, bm2, bn2 = default_blocks(dtype, d, mask)
        if softcap is not None:
            extra["softcap"] = softcap
        return KernelSpec("flash_attention", dtype=dtype, head_dim=d, mask=mask, causal=causal, documents=documents,
                          group=group, block_m=bm, block_n=bn, bwd_block_m=bm2, bwd_block_n=bn2, **extra)
    return [spec("bf16", 128, "full", True, group=4),
            spec("bf16", 128, "full", True, group=4, precision=None),
            spec("bf16", 128, "window", True, documents=True, softcap=30.0, precision=None),
            spec("bf16", 64, "bigbird", True, bigbird_block=16, precision=None),
            spec("fp16", 128, "full", True, documents=True),
            spec("fp32", 64, "full", False),
            spec("fp32", 128, "full", True, softcap=50.0),
            spec("bf16", 64, "full", True, group=8, softcap=30.0),
            spec("bf16", 128, "window", True, documents=True, group=2),
            spec("fp16", 64, "window", False, softcap=50.0),
            spec("fp32", 128, "window", False, documents=True, softcap=30.0),
            spec("bf16", 64, "bigbird", False, bigbird_block=64),
            spec("fp16", 128, "bigbird", True, group=4, bigbird_block=16),
            spec("bf16", 128, "dilated", True, documents=True, group=2),
            spec("fp16", 64, "dilated", True, group=4),
            spec("fp32", 64, "dilated", False),
            spec("bf16", 128, "full", True, group=4, key_bias=True, precision=None),
            spec("fp32", 64, "window", True, documents=True, softcap=30.0, key_bias=True)]
