"""The fuzzer's ``equal_dims`` class: values carrying two or three sequence-like dims of one
length (frames × patches × rows), attended one at a time or merged, with the reshapes,
transposes and RoPE around them that video and image models write.

A case's ``variant`` spells the program (:func:`draw_variant` draws it, :func:`parse` reads
it): ``"<dims>|<steps>|<how>|<rope>"``. The input is ``x [B, n, n(, n), E]`` (``n`` is
``FuzzCase.seq``); each step, in order, is

- ``a<i>``: a residual attention over dim ``i`` of the ``n``-long dims, the others batch
  (factorised space-time attention: spatial within a frame, temporal per patch);
- ``m<i><j>``: a residual attention over dims ``i`` and ``j`` merged (``n²`` tokens in
  ``i``-major order; ``j = i + 1`` is the plain ``[B, T·P, C]`` of a DiT);
- ``s<i><j>``: ``x`` with dims ``i`` and ``j`` swapped (the program goes on transposed).

``how`` says how a one-dim attention is spelled: ``reshape`` (the attended dim moved next
to the batch, the others merged into it, ``[B·T, P, H, D]``, and back) or ``batched`` (one
einsum with the other dims as batch dims, ``btqhd,btkhd->bthqk``). ``rope`` is ``none``,
``own`` (positions ``jnp.arange(n)`` per attention, on the 4-D view of the reshaped
operands), ``shared`` (one cos/sin table of ``n`` positions for every step) or ``around``
(q and k projected on the whole value, reshaped to ``[B·rest, n, H, D]`` for the rotation
and back: the spelling that once went wrong). The loss compares ``x`` with a target and
pools over one dim.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

HOWS = ("reshape", "batched")
ROPES = ("none", "own", "shared", "around")
#: The draws of ``how`` and ``rope``: the batched spelling and the RoPE around a reshape
#: (the frames merged with the batch: what once lost the frames' order) twice as often.
HOW_DRAWS = HOWS + ("batched",)
ROPE_DRAWS = ROPES + ("around",)


@dataclass(frozen=True)
class Program:
    """A parsed ``equal_dims`` variant."""

    dims: int
    steps: tuple[str, ...]
    how: str
    rope: str


def parse(variant: str) -> Program:
    dims, steps, how, rope = variant.split("|")
    return Program(int(dims), tuple(steps.split(",")), how, rope)


def _step_options(dims: int) -> tuple[str, ...]:
    pairs = list(itertools.combinations(range(dims), 2))
    return (tuple(f"a{i}" for i in range(dims)) + tuple(f"m{i}{j}" for i, j in pairs)
            + tuple(f"s{i}{j}" for i, j in pairs))


def draw_variant(choose: Callable[[str, tuple], Any]) -> str:
    """A variant string: the number of dims, 2 to 4 steps (at least two attentions, one of
    them over a single dim), how they are spelled and the RoPE."""
    dims = choose("equal_dims", (2, 3))
    options = _step_options(dims)
    steps = [choose("first_step", tuple(f"a{i}" for i in range(dims)))]
    for _ in range(choose("more_steps", (1, 2, 3))):
        steps.append(choose("step", options))
    if all(s.startswith("s") for s in steps[1:]):
        steps.append(choose("last_step", tuple(f"a{i}" for i in range(dims))))
    return "|".join((str(dims), ",".join(steps), choose("how", HOW_DRAWS),
                     choose("dim_rope", ROPE_DRAWS)))


def params_and_inputs(case, rng) -> tuple[dict, dict]:
    """Random weights (one set per attention step) and the input ``x [B, n, .., E]``."""
    program = parse(case.variant)
    b, n, e = case.batch, case.seq, case.model_dim
    h, d = case.heads, case.head_dim
    shape = (b,) + (n,) * program.dims + (e,)

    def normal(*s, scale=1.0):
        return (rng.standard_normal(s) * scale).astype(np.float32)

    layers = []
    for step in program.steps:
        if step.startswith("s"):
            continue
        layers.append({"wq": normal(e, h * d, scale=1 / math.sqrt(e)),
                       "wk": normal(e, h * d, scale=1 / math.sqrt(e)),
                       "wv": normal(e, h * d, scale=1 / math.sqrt(e)),
                       "wo": normal(h * d, e, scale=1 / math.sqrt(h * d)),
                       "g": (1.0 + 0.1 * rng.standard_normal(e)).astype(np.float32)})
    return {"x": normal(*shape), "target": normal(*shape), "layers": layers}, {}


def _cos_sin(n: int, d: int):
    inv = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = jnp.arange(n, dtype=jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def _rotate(x, table):
    """RoPE of ``x [N, n, H, D]`` along dim 1 with ``table = (cos, sin) [n, D/2]``."""
    cos, sin = (t[None, :, None, :] for t in table)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _to_front(x, dims: tuple[int, ...]):
    """``x [B, *seq dims, H, D]`` with seq dims ``dims`` (counted from 0 after ``B``) moved
    right after ``B`` (in that order) and the other seq dims after them; with the inverse
    permutation."""
    nd = x.ndim - 3
    rest = [i for i in range(nd) if i not in dims]
    perm = (0, *(1 + i for i in dims), *(1 + i for i in rest), nd + 1, nd + 2)
    return jnp.transpose(x, perm), tuple(int(i) for i in np.argsort(perm))


def _attend_one(case, attend, q, k, v, axis: int, how: str, table):
    """Attention over seq dim ``axis`` of ``[B, n.., H, D]`` operands, the others batch."""
    if how == "batched":
        if table is not None:
            q, k = _along(q, axis, table), _along(k, axis, table)
        return _batched(case, q, k, v, axis)
    (q, k, v), backs = zip(*(_to_front(t, (axis,)) for t in (q, k, v)))
    moved = q.shape                                   # [B, n, rest.., H, D]
    q, k, v = (jnp.moveaxis(t, 1, -3).reshape((-1,) + moved[1:2] + moved[-2:])
               for t in (q, k, v))                    # [B·rest, n, H, D]
    if table is not None:
        q, k = _rotate(q, table), _rotate(k, table)
    o = attend(replace(case, seq=moved[1]), q, k, v)
    o = jnp.moveaxis(o.reshape(moved[:1] + moved[2:-2] + moved[1:2] + moved[-2:]), -3, 1)
    return jnp.transpose(o, backs[0])


def _along(t, axis: int, table):
    """RoPE of ``t [B, n.., H, D]`` along its seq dim ``axis``, on the view with that dim
    first and the others merged with the heads."""
    moved, back = _to_front(t, (axis,))
    flat = moved.reshape(moved.shape[:2] + (-1, moved.shape[-1]))
    return jnp.transpose(_rotate(flat, table).reshape(moved.shape), back)


_LETTERS = "tuvw"


def _batched(case, q, k, v, axis: int):
    """One einsum over the seq dim ``axis`` with the others as batch dims (causal by an
    iota comparison when the case is causal)."""
    others = [_LETTERS[i] for i in range(q.ndim - 3)]
    qs, ks = list(others), list(others)
    qs[axis], ks[axis] = "q", "k"
    qs, ks = "".join(qs), "".join(ks)
    batch = "".join(c for i, c in enumerate(others) if i != axis)
    logits = jnp.einsum(f"b{qs}hd,b{ks}hd->b{batch}hqk", q, k) / math.sqrt(q.shape[-1])
    if case.causal:
        n = q.shape[1 + axis]
        logits = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], logits, -1e9)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum(f"b{batch}hqk,b{ks}hd->b{qs}hd", p, v)


def _attend_merged(case, attend, q, k, v, dims: tuple[int, int]):
    """Attention over seq dims ``dims`` merged (``dims[0]``-major), the other dim batch."""
    (q, k, v), back = zip(*(_to_front(t, dims) for t in (q, k, v)))
    shape = q.shape
    lead = lambda t: jnp.moveaxis(  # noqa: E731
        t.reshape((t.shape[0], t.shape[1] * t.shape[2]) + t.shape[3:]), 1, -3)
    q, k, v = (lead(t) for t in (q, k, v))         # [B, rest.., n², H, D]
    length = q.shape[-3]
    flat = lambda t: t.reshape((-1, length) + t.shape[-2:])  # noqa: E731
    o = attend(replace(case, seq=length), flat(q), flat(k), flat(v))
    o = o.reshape(q.shape)
    o = jnp.moveaxis(o, -3, 1).reshape(shape)
    return jnp.transpose(o, back[0])


def _project(x, w, heads: int, d: int):
    y = x @ w
    return y.reshape(y.shape[:-1] + (heads, d))


def _around(q, axis: int, table):
    """The RoPE of the seq dim ``axis`` applied to ``q [B, n.., H, D]`` through a reshape to
    ``[B·rest, n, H, D]`` and back (rest: the seq dims before it merged with the batch,
    those after it merged with the heads)."""
    shape = q.shape
    lead = int(np.prod(shape[:1 + axis]))
    n = shape[1 + axis]
    flat = q.reshape(lead, n, -1, shape[-1])
    return _rotate(flat, table).reshape(shape)


def loss(case, attend, p: dict, inputs: dict):
    """The program of ``case.variant``; ``attend(case, q, k, v)`` is the fuzzer's attention
    in the drawn spelling (``q [N, S, H, D]``)."""
    del inputs
    program = parse(case.variant)
    x = p["x"]
    n, h, d = case.seq, case.heads, case.head_dim
    shared = _cos_sin(n, d) if program.rope in ("shared", "around") else None
    layers = iter(p["layers"])
    for step in program.steps:
        i, j = (int(c) for c in step[1:].ljust(2, "0"))
        if step.startswith("s"):
            x = jnp.swapaxes(x, 1 + i, 1 + j)
            continue
        w = next(layers)
        hx = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w["g"]
        q, k, v = (_project(hx, w[name], h, d) for name in ("wq", "wk", "wv"))
        if step.startswith("m"):
            o = _attend_merged(case, attend, q, k, v, (i, j))
        else:
            table = None
            if program.rope == "around":
                q, k = _around(q, i, shared), _around(k, i, shared)
            elif program.rope == "shared":
                table = shared
            elif program.rope == "own":
                table = _cos_sin(n, d)
            o = _attend_one(case, attend, q, k, v, i, program.how, table)
        x = x + o.reshape(o.shape[:-2] + (-1,)) @ w["wo"]
    pooled = jnp.mean(x, axis=1)
    return jnp.mean((x - p["target"]) ** 2) + jnp.mean(jnp.tanh(pooled) ** 2)
