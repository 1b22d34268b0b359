"""What one attention computes: operand layouts, scale, soft-cap, GQA and the mask.

These frozen dataclasses are the params of ``attention_p``; every pass and schedule reads
them, none re-derives them from shapes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cptransform.ir.spelled_enum import SpelledEnum
from cptransform.op import mask_terms
from cptransform.op.dropout import DropoutSpec
from cptransform.op.layouts import SequenceLayout
from cptransform.op.operand_roles import BASE_ROLES, Role

#: Every canonical operand's :class:`~cptransform.op.operand_roles.Role`, by field name:
#: the base operands' and those the mask terms bring.
ROLES: dict[str, Role] = {**BASE_ROLES, **mask_terms.TERM_ROLES}
#: Every ``attention_p`` operand name (:meth:`AttentionSpec.operand_names` picks the present).
OPERAND_NAMES: tuple[str, ...] = ("q", "k", "v") + tuple(
    role.operand for role in ROLES.values() if role.operand)


class EmptyRows(SpelledEnum):
    """What a query row that sees no key returns (see :class:`MaskSpec`)."""

    ZERO = "zero"
    UNIFORM = "uniform"
    NAN = "nan"


@dataclass(frozen=True)
class Layout:
    """Which dimensions of one operand are batch, sequence, heads and features.

    ``batch`` may hold several dims (or none); ``heads`` is ``None`` for a single-head
    operand without a heads dim (for K/V that means MQA: one KV head shared by all).
    """

    batch: tuple[int, ...]
    seq: int
    heads: int | None
    feature: int

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse letters such as ``"BTHD"``, ``"BHTD"``, ``"TD"``; ``B`` may repeat."""
        text = text.upper()
        allowed = set("BTHD")
        if not set(text) <= allowed or text.count("T") != 1 or text.count("D") != 1 \
                or text.count("H") > 1:
            raise ValueError(
                f"layout {text!r}: use the letters B (batch, any number), T (sequence, once), "
                "H (heads, at most once) and D (features, once), e.g. 'BTHD' or 'BHTD'")
        heads = text.index("H") if "H" in text else None
        return cls(tuple(i for i, c in enumerate(text) if c == "B"), text.index("T"), heads,
                   text.index("D"))

    @property
    def ndim(self) -> int:
        return len(self.batch) + 2 + (self.heads is not None)

    def canonical_perm(self) -> tuple[int, ...]:
        """The transpose that brings this operand to ``(*batch, seq, [heads,] feature)``."""
        heads = () if self.heads is None else (self.heads,)
        return (*self.batch, self.seq, *heads, self.feature)

    def with_leading_batch(self) -> "Layout":
        """This layout after a new batch dim is inserted at position 0 (vmap)."""
        shift = lambda d: None if d is None else d + 1  # noqa: E731
        return Layout((0, *(b + 1 for b in self.batch)), self.seq + 1, shift(self.heads),
                      self.feature + 1)

    def letters(self) -> str:
        out = [""] * self.ndim
        for b in self.batch:
            out[b] = "B"
        out[self.seq] = "T"
        out[self.feature] = "D"
        if self.heads is not None:
            out[self.heads] = "H"
        return "".join(out)


@dataclass(frozen=True)
class MaskSpec:
    """Which (query, key) pairs are visible: a conjunction of predicates on positions.

    With ``d = kv_pos - q_pos`` (global token positions):

    * ``causal``: ``d <= causal_offset``;
    * ``window=(left, right)``: ``-left <= d <= right`` (``None`` leaves a side open);
    * ``segments``: ``q_segment_ids[q] == kv_segment_ids[kv]`` (two operands);
    * ``dense``: a boolean operand ``mask[..., q, kv]``;
    * ``bias``: an additive float operand (not a predicate; added to the logits);
    * ``topk``: an int operand ``indices[..., q, :]`` of selected key positions (a sparse
      attention indexer's top-k): key ``kv`` is visible to ``q`` iff its position is one of
      ``indices[..., q, :]``. Repeated indices select a key once; an index that is no key's
      position selects nothing. It is and-ed with the other predicates, so the keys a
      top-k picks among masked (``-inf``) scores stay hidden by the causal part;
    * ``chunk=C`` (Llama-4 chunked attention): ``q_pos // C == kv_pos // C``, each token
      sees only its own fixed chunk of ``C`` positions (with ``causal``, its earlier ones);
    * ``q_padding``/``kv_padding``: ``q_valid[q]`` / ``kv_valid[kv]``, boolean per-token
      operands (a padded batch's validity vector, ``tokens != pad``: a padded query sees
      no key, a padded key is seen by no query);
    * ``coordinate_band=(lo, hi)``: ``lo <= kv_pos - q_coordinates[q] <= hi`` (``None``
      leaves a side open) with an int operand ``q_coordinates[..., q]``: a window around a
      per-query data coordinate instead of the query's position (DeepMind gemma's local
      layer: ``cumsum(input_mask) - 1``). Coordinates and positions are int32 and
      ``kv_pos - q_coordinates`` must not overflow (``|q_coordinates| < 2**30``).

    :meth:`terms` gives the predicate as :mod:`~cptransform.op.mask_terms` terms, which
    every kernel, the cost model and the plan chart read.

    ``empty_rows`` says what a query with no visible key returns: ``"zero"`` (zero output,
    zero gradient; what :func:`cptransform.attention` does) or ``"uniform"`` (the mean of V
    over all keys: what softmax over logits filled with a finite minimum gives, as in
    ``jax.nn.dot_product_attention`` and flax) or ``"nan"`` (NaN, with a NaN gradient for
    every V: what softmax over logits filled with ``-inf`` gives). A row is empty when it
    receives no probability mass: no visible key, or only ``-inf`` visible logits.

    ``added_fill`` (only with ``"uniform"``): the finite fill was *added* to the scores
    (``logits + where(mask, 0, finfo.min)``, transformers' attention bias), not selected.
    On one device an empty row's softmax is then uniform but its scores still receive the
    gradient of that uniform softmax, so the row's query and every key get a gradient; the
    schedules reproduce it (:func:`~cptransform.op.attention_reference.added_fill_term`).

    ``fill`` (a finite float, or ``None``): the masked pairs are not hidden but take this
    logit in place of theirs (``softmax(where(mask, s, fill))`` with a fill too large to
    hide, e.g. ``-8`` before a soft-cap): each masked key keeps a share ``exp(fill)`` of
    its row's probability and its logit gets no gradient. No pair is then skipped and no
    row is empty, so :meth:`hiding_terms` is empty (what block skipping, the band and the
    cost model read) while :meth:`terms` is still the predicate the kernels fill by.
    """

    causal: bool = False
    causal_offset: int = 0
    window: tuple[int | None, int | None] | None = None
    segments: bool = False
    dense: bool = False
    bias: bool = False
    empty_rows: EmptyRows | str = EmptyRows.ZERO.value
    topk: bool = False
    chunk: int | None = None
    added_fill: bool = False
    coordinate_band: tuple[int | None, int | None] | None = None
    q_padding: bool = False
    kv_padding: bool = False
    fill: float | None = None
    region_padding: tuple[int | None, int | None] | None = None

    def __post_init__(self):
        if self.fill is not None and not (isinstance(self.fill, float) and math.isfinite(self.fill)
                                          and self.empty_rows == EmptyRows.ZERO.value):
            raise ValueError("fill is a finite float logit the masked pairs take (no row is "
                             f"then empty: empty_rows='zero'), got fill={self.fill!r}, "
                             f"empty_rows={self.empty_rows!r}")
        if self.empty_rows not in EmptyRows.spellings():
            raise ValueError(f"empty_rows must be one of {', '.join(EmptyRows.spellings())}, "
                             f"got {self.empty_rows!r}")
        if self.added_fill and self.empty_rows != EmptyRows.UNIFORM.value:
            raise ValueError("added_fill describes a finite fill added to the scores: it "
                             f"needs empty_rows='uniform', got {self.empty_rows!r}")
        if self.window is not None:
            left, right = self.window
            for side in (left, right):
                if side is not None and (not isinstance(side, int) or side < 0):
                    raise ValueError(f"window sides must be non-negative ints or None, got "
                                     f"{self.window}")
        if self.chunk is not None and (not isinstance(self.chunk, int) or self.chunk < 1):
            raise ValueError(f"chunk must be a positive int or None, got {self.chunk!r}")
        if self.coordinate_band is not None:
            lo, hi = self.coordinate_band
            if any(x is not None and not isinstance(x, int) for x in (lo, hi)) \
                    or (lo is not None and hi is not None and lo > hi):
                raise ValueError("coordinate_band must be (lo, hi) ints or None with lo <= hi, "
                                 f"got {self.coordinate_band!r}")
        if self.region_padding is not None:
            lo, hi = self.region_padding
            if any(x is not None and not isinstance(x, int) for x in (lo, hi)) \
                    or (lo is None and hi is None) or (lo is not None and hi is not None
                                                       and lo > hi):
                raise ValueError("region_padding must be (lo, hi) ints or None, not both None, "
                                 f"with lo <= hi, got {self.region_padding!r}")

    def terms(self) -> tuple:
        """The predicate as a tuple of :mod:`~cptransform.op.mask_terms` terms (their
        conjunction); the bias is not a predicate and has none."""
        lo = hi = None
        if self.causal:
            hi = self.causal_offset
        if self.window is not None:
            left, right = self.window
            if left is not None:
                lo = -left
            if right is not None:
                hi = right if hi is None else min(hi, right)
        out = [] if lo is None and hi is None else [mask_terms.Band(lo, hi)]
        if self.chunk is not None:
            out.append(mask_terms.Chunks(self.chunk))
        if self.coordinate_band is not None:
            out.append(mask_terms.CoordinateBand(*self.coordinate_band))
        if self.segments:
            out.append(mask_terms.Segments())
        if self.q_padding:
            out.append(mask_terms.QueryPadding())
        if self.kv_padding:
            out.append(mask_terms.KeyPadding())
        if self.region_padding is not None:
            out.append(mask_terms.RegionPadding(*self.region_padding))
        if self.dense:
            out.append(mask_terms.Dense())
        if self.topk:
            out.append(mask_terms.TopK())
        return tuple(out)

    def hiding_terms(self) -> tuple:
        """The terms whose masked pairs receive no probability (what block skipping and
        the cost model may drop): :meth:`terms`, or none under a finite ``fill``."""
        return () if self.fill is not None else self.terms()

    def band(self) -> tuple[int | None, int | None]:
        """Bounds ``(lo, hi)`` on ``d = kv_pos - q_pos`` that every pair receiving
        probability satisfies (the hull of the :meth:`hiding_terms`' bands: causal, window,
        chunks; ``None``: open)."""
        return mask_terms.band_of(self.hiding_terms())

    @property
    def is_trivial(self) -> bool:
        """True when every pair is visible and nothing is added to the logits."""
        return mask_terms.band_of(self.terms()) == (None, None) and not (
            self.segments or self.dense or self.bias or self.topk or self.q_padding
            or self.kv_padding or self.region_padding is not None
            or self.coordinate_band is not None)

    def describe(self) -> str:
        parts = []
        if self.causal:
            parts.append("causal" if self.causal_offset == 0 else f"causal({self.causal_offset:+d})")
        if self.window is not None:
            left, right = self.window
            parts.append(f"window=({'inf' if left is None else left},"
                         f"{'inf' if right is None else right})")
        if self.chunk is not None:
            parts.append(f"chunk={self.chunk}")
        if self.coordinate_band is not None:
            lo, hi = self.coordinate_band
            parts.append(f"coordinate_band=({'-inf' if lo is None else lo},"
                         f"{'inf' if hi is None else hi})")
        if self.segments:
            parts.append("segments")
        if self.q_padding:
            parts.append("query_padding")
        if self.kv_padding:
            parts.append("key_padding")
        if self.region_padding is not None:
            lo, hi = self.region_padding
            parts.append(f"region_padding=({'-inf' if lo is None else lo},"
                         f"{'inf' if hi is None else hi})")
        if self.dense:
            parts.append("dense")
        if self.topk:
            parts.append("topk")
        if self.bias:
            parts.append("bias")
        if self.empty_rows != "zero":
            parts.append(f"empty={self.empty_rows}" + ("(added)" if self.added_fill else ""))
        if self.fill is not None:
            parts.append(f"fill={self.fill:g}")
        return " ".join(parts) if parts else "full"

    def replace(self, **changes) -> "MaskSpec":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class AttentionSpec:
    """Everything ``attention_p`` needs besides its operands.

    Operands, in order: ``q, k, v``, then ``q_positions, kv_positions`` if ``positions``,
    ``q_segment_ids, kv_segment_ids`` if ``mask.segments``, ``q_valid`` if
    ``mask.q_padding``, ``kv_valid`` if ``mask.kv_padding``, ``kv_inside, kv_outside`` if
    ``mask.region_padding``, ``mask`` if ``mask.dense``,
    ``bias`` if ``mask.bias``, ``sinks`` if ``sinks``, ``topk_indices`` if ``mask.topk``,
    ``q_coordinates`` if ``mask.coordinate_band``, ``dropout_seed`` if ``dropout``. The
    output has q's layout with v's feature size.

    Shapes of the optional operands, with ``nb = len(q.batch)`` leading batch dims that
    follow q's batch dims in order and may be 1 (broadcast):
    positions, segment ids and query coordinates ``(*batch, T)`` (int), ``q_valid``,
    ``kv_valid``, ``kv_inside`` and ``kv_outside`` ``(*batch, T)`` (bool); mask and bias
    ``(*batch, heads|1, Tq, Tkv)``; sinks ``(*batch, heads)`` (float; ``heads`` is 1 for q
    without a heads dim); top-k indices ``(*batch, heads|1, Tq, k)`` (int32, key
    positions); the dropout seed ``(*batch, heads, 4)`` (uint32, see
    :mod:`~cptransform.op.dropout`). Without ``positions`` they are ``arange(T)``.

    ``dropout`` (:class:`~cptransform.op.dropout.DropoutSpec`): the probabilities are
    multiplied by the dropout multiplier of the bits the program draws, before the value
    product; the normaliser is not.

    ``logits = softcap(scale * q·k) + bias``; ``groups`` query heads share one KV head
    (query head ``h`` reads KV head ``h // groups``).

    ``sinks`` (gpt-oss "attention sinks"): one more logit per query head in every row's
    log-sum-exp, a column whose value is 0: ``lse = logaddexp(lse_keys, sink[h])``,
    ``o = Σ_j exp(l_j - lse) v_j``. It has no sequence axis and is added once per row. A row
    with no visible key but a finite sink puts all its mass on the sink: ``o = 0`` whatever
    ``mask.empty_rows`` says (softmax over ``-inf`` or finite-minimum fills and a sink gives
    exactly that on one device); ``mask.empty_rows`` applies only to rows whose sink is
    ``-inf`` too. A NaN or ``+inf`` sink makes its rows NaN, as the softmax does.

    ``schedule``, ``layout`` and ``kernel`` (the registry name of the local-step kernel,
    e.g. ``"xla"``) are the context-parallel decisions for this attention, written onto the
    equation by ``plan-context-parallel`` and read by ``lower-context-parallel`` (``None``
    until planned): a decision travels with its equation through nesting, re-tracing and
    repetition, never by visit order.

    ``real_keys`` is set only on the spec a context-parallel schedule receives when the
    lowering padded the keys to the layout's multiple: how many keys are real (padded keys
    are masked out and their V rows are zero, so the ``"uniform"`` fill divides the sum of
    V by this count, not by the padded length).

    ``kv_positions_layout`` is set only on the spec a context-parallel schedule receives
    when the kv positions are the layout's own (the caller's program gave none): the key at
    layout-order slot ``s`` (over all, padded, keys) has position
    ``kv_positions_layout.position_of_slot(s)``. The ring then derives the positions of
    each arriving block from its source rank instead of sending them.
    """

    q: Layout
    k: Layout
    v: Layout
    scale: float
    softcap: float | None = None
    groups: int = 1
    mask: MaskSpec = MaskSpec()
    positions: bool = False
    sinks: bool = False
    schedule: str | None = None
    layout: str | None = None
    kernel: str | None = None
    real_keys: int | None = None
    kv_positions_layout: SequenceLayout | None = None
    dropout: DropoutSpec | None = None

    def operand_names(self) -> tuple[str, ...]:
        names = ["q", "k", "v"]
        if self.positions:
            names += ["q_positions", "kv_positions"]
        if self.mask.segments:
            names += ["q_segment_ids", "kv_segment_ids"]
        if self.mask.q_padding:
            names.append("q_valid")
        if self.mask.kv_padding:
            names.append("kv_valid")
        if self.mask.region_padding is not None:
            names += ["kv_inside", "kv_outside"]
        if self.mask.dense:
            names.append("mask")
        if self.mask.bias:
            names.append("bias")
        if self.sinks:
            names.append("sinks")
        if self.mask.topk:
            names.append("topk_indices")
        if self.mask.coordinate_band is not None:
            names.append("q_coordinates")
        if self.dropout is not None:
            names.append("dropout_seed")
        return tuple(names)

    def describe(self) -> str:
        """Compact text, e.g. ``causal window=(128,0) gqa=4``."""
        parts = [self.mask.describe()]
        if self.groups > 1:
            parts.append(f"gqa={self.groups}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.positions:
            parts.append("positions")
        if self.sinks:
            parts.append("sinks")
        if self.dropout is not None:
            parts.append(self.dropout.describe())
        if self.schedule is not None:
            parts.append(f"schedule={self.schedule} layout={self.layout}")
        if self.kernel is not None:
            parts.append(f"kernel={self.kernel}")
        layouts = {self.q.letters(), self.k.letters(), self.v.letters()}
        if layouts != {"BTHD"}:
            parts.append("layout=" + ",".join([self.q.letters(), self.k.letters(), self.v.letters()]))
        parts.append(f"scale={self.scale:.4g}")
        return " ".join(parts)

    def replace(self, **changes) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)
