"""Random attention problems for the schedule tests, and the check against the reference.

A case is the operands of one ``attention_p`` (canonical ``BTHD`` layouts) plus its spec.
:func:`check_schedule` runs :func:`context_parallel_attention` and compares output and
``jax.grad`` w.r.t. q, k, v (and bias and sinks) with the unsharded reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from cptransform.op.attention_reference import attention_reference
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.lowering.context_parallel_attention import context_parallel_attention
from cptransform.lowering.schedule import schedules

MASK_KINDS = ("none", "causal", "window", "causal_window", "segments", "dense",
              "dense_causal", "bias")
#: (query heads, kv heads) per head sharing kind.
HEAD_KINDS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

BTHD = Layout.parse("BTHD")


@dataclass(frozen=True)
class Case:
    """One attention problem: ``operands`` in ``attention_p`` order and its ``spec``."""

    operands: tuple
    spec: AttentionSpec

    @property
    def differentiable(self) -> tuple[int, ...]:
        names = self.spec.operand_names()
        return tuple(i for i, n in enumerate(names) if n in ("q", "k", "v", "bias", "sinks"))


def mask_spec(kind: str, empty_rows: str = "zero") -> MaskSpec:
    """The :class:`MaskSpec` of a mask kind named in :data:`MASK_KINDS`."""
    return MaskSpec(
        causal=kind in ("causal", "causal_window", "dense_causal"),
        window={"window": (3, 2), "causal_window": (5, None)}.get(kind),
        segments=kind == "segments", dense=kind in ("dense", "dense_causal"),
        bias=kind == "bias", empty_rows=empty_rows)


def make_case(rng, kind: str = "none", heads: str = "mha", *, batch: int = 2, seq: int = 32,
              d: int = 8, dv: int = 8, dtype=jnp.float32, empty_rows: str = "zero",
              dense_heads: bool = True, sinks: bool = False) -> Case:
    """Random q, k, v (and segment ids, dense mask or bias as ``kind`` needs; with
    ``sinks``, a random sink per query head, shared by the batch)."""
    h, hkv = HEAD_KINDS[heads]
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    operands = [normal(batch, seq, h, d), normal(batch, seq, hkv, d), normal(batch, seq, hkv, dv)]
    mspec = mask_spec(kind, empty_rows)
    if mspec.segments:
        ids = np.sort(rng.integers(0, 4, size=(batch, seq)), axis=1).astype(np.int32)
        operands += [jnp.asarray(ids), jnp.asarray(ids)]
    mh = h if dense_heads else 1
    if mspec.dense:
        dense = rng.random((batch, mh, seq, seq)) < 0.3
        dense[:, :, 1] = False  # a query that sees no key: zero (or uniform) output
        operands.append(jnp.asarray(dense))
    if mspec.bias:
        operands.append(normal(1, mh, seq, seq))
    if sinks:
        operands.append(normal(1, h))
    spec = AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=1.0 / math.sqrt(d), groups=h // hkv,
                         mask=mspec, sinks=sinks)
    return Case(tuple(operands), spec)


POSITION_MASKS = {"causal": MaskSpec(causal=True), "window": MaskSpec(window=(3, 2)),
                  "topk": MaskSpec(causal=True, topk=True)}


def position_case(rng, kind, seq, explicit):
    """GQA q, k, v of ``seq`` tokens under a mask that reads positions (top-k: 4 random key
    positions per row, causal too); with ``explicit``, the caller's positions, a random
    permutation: a schedule that derived the layout's positions would get another answer."""
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    operands = [normal(2, seq, 8, 8), normal(2, seq, 2, 8), normal(2, seq, 2, 8)]
    if explicit:
        operands += [jnp.asarray(rng.permutation(seq)[None], jnp.int32)] * 2
    if kind == "topk":
        operands.append(jnp.asarray(rng.integers(0, seq, (2, 1, seq, 4)), jnp.int32))
    spec = AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=8 ** -0.5, groups=4,
                         mask=POSITION_MASKS[kind], positions=explicit)
    return Case(tuple(operands), spec)


#: Mesh shapes the tests cycle through, by a schedule's number of mesh axes.
MESH_SHAPES = {1: ((2,), (4,), (8,)), 2: ((2, 2), (2, 4), (4, 2))}


def schedule_axes(schedule: str) -> tuple[str, ...]:
    """The mesh axis names ``schedule`` runs over, read off its registered record: a
    two-axis schedule's (inner, outer) names, else ``("cp",)``."""
    record = schedules()[schedule]
    return record.inner.names if record.inner is not None else ("cp",)


def schedule_mesh_shapes(schedule: str) -> tuple[tuple[int, ...], ...]:
    """The mesh shapes of :data:`MESH_SHAPES` for ``schedule``'s number of mesh axes."""
    return MESH_SHAPES[schedules()[schedule].mesh_axes]


def relative_error(got, want) -> float:
    """Largest absolute difference over the largest magnitude of ``want``, on the entries
    finite in ``want``; ``inf`` when the NaN or ±Inf entries of the two differ."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = np.isfinite(want)
    same_specials = np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(
        got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    if not same_specials:
        return float("inf")
    diff = np.max(np.abs(got[finite] - want[finite]), initial=0.0)
    return float(diff / max(np.max(np.abs(want[finite]), initial=0.0), 1e-30))


def check_schedule(case: Case, *, mesh, axes, schedule: str, layout: str,
                   grad: bool = True, tol: float | None = None, kernel: str = "xla") -> None:
    """Assert output and gradients of the schedule (with the local ``kernel``) match the
    unsharded reference.

    Gradients are w.r.t. q, k, v, bias and sinks, of ``sum(o * w)`` for a random ``w``; each side
    is one jitted ``vjp`` (one compile per side).
    """
    dtype = case.operands[0].dtype
    tol = TOLERANCE[jnp.dtype(dtype).type] if tol is None else tol
    diff = case.differentiable

    q, v = case.operands[0], case.operands[2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=out_shape), dtype)

    def with_grads(fn):
        def run(weights, *xs):
            def on_diff(*ds):
                full = list(xs)
                for i, x in zip(diff, ds):
                    full[i] = x
                return fn(*full)
            out, vjp = jax.vjp(on_diff, *(xs[i] for i in diff))
            return out, (vjp(weights) if grad else ())
        return jax.jit(run)

    sharded = with_grads(lambda *xs: context_parallel_attention(
        *xs, spec=case.spec, mesh=mesh, axes=axes, schedule=schedule, layout=layout,
        kernel=kernel))
    reference = with_grads(lambda *xs: attention_reference(*xs, spec=case.spec))
    (got, got_grads), (want, want_grads) = sharded(weights, *case.operands), \
        reference(weights, *case.operands)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = relative_error(got, want)
    assert err <= tol, f"output relative error {err:.3g} > {tol:g}"
    names = [case.spec.operand_names()[i] for i in diff]
    for name, g, w in zip(names, got_grads, want_grads):
        err = relative_error(g, w)
        assert err <= tol, f"d{name} relative error {err:.3g} > {tol:g}"
