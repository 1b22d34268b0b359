"""Sequence-mixing layers that are recurrences, in plain JAX, the way their papers write them.

Each layer maps ``x [B, S, D]`` to ``[B, S, D]`` with its parameters from
:func:`init`; nothing here knows about cptransform. ``hybrid_block`` puts one of them
before a causal attention, as hybrid models interleave them.

* ``mamba``: Mamba's selective scan, a diagonal state ``[B, D, N]`` carried by
  ``lax.scan`` over the tokens (``h = exp(Δ·A)·h + Δ·B·x``);
* ``linear_attention``: causal linear attention by ``cumsum`` of ``k vᵀ`` (the state of
  every token, ``[B, S, H, d, d]``) and of ``k``;
* ``gla``: gated linear attention in chunk form (``lax.scan`` across chunks of ``chunk``
  tokens: a state ``[B, H, d, d]`` decayed per key dim, attention inside each chunk);
* ``rg_lru``: Griffin's RG-LRU with ``lax.associative_scan`` over ``(a, b)`` pairs;
* ``deltanet``: DeltaNet's delta rule, a matrix state ``S - β k (kᵀS - vᵀ)`` by ``lax.scan``;
* ``ema``: an exponential moving average with data-dependent decay by ``cumprod``;
* ``gru``: a GRU by ``lax.scan`` (its carry is not affine).

Every layer takes ``cut=True`` for its twin without the recurrence: the same computation
with each step's state started afresh (a token-wise op), the control that isolates what
the recurrence itself costs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

HEADS = 2
STATE = 4     # Mamba's state size N
CHUNK = 8     # GLA's chunk length


def _dense(key, n_in, n_out):
    return jax.random.normal(key, (n_in, n_out)) / jnp.sqrt(n_in)


def init(name: str, key, dim: int) -> dict:
    """Parameters of layer ``name`` for model width ``dim``."""
    keys = iter(jax.random.split(key, 8))
    if name == "mamba":
        return {"dt": _dense(next(keys), dim, dim), "b": _dense(next(keys), dim, STATE),
                "c": _dense(next(keys), dim, STATE),
                "a_log": jnp.log(jnp.arange(1, STATE + 1, dtype=jnp.float32))
                * jnp.ones((dim, 1))}
    if name in ("linear_attention", "gla", "deltanet"):
        p = {w: _dense(next(keys), dim, dim) for w in ("q", "k", "v", "o")}
        p["g"] = _dense(next(keys), dim, dim if name == "gla" else HEADS)
        return p
    if name == "rg_lru":
        return {"a": _dense(next(keys), dim, dim), "i": _dense(next(keys), dim, dim),
                "lam": jax.random.uniform(next(keys), (dim,), minval=1.0, maxval=3.0)}
    if name == "ema":
        return {"a": _dense(next(keys), dim, dim)}
    if name == "gru":
        return {w: _dense(next(keys), dim, dim) for w in ("wz", "wr", "wh", "uz", "ur", "uh")}
    raise KeyError(name)


def mamba(p, x, cut=False):
    delta = jax.nn.softplus(x @ p["dt"])                                   # [B, S, D]
    a = -jnp.exp(p["a_log"])                                               # [D, N]
    da = jnp.exp(delta[..., None] * a)                                     # [B, S, D, N]
    dbx = (delta * x)[..., None] * (x @ p["b"])[:, :, None, :]             # [B, S, D, N]
    c = x @ p["c"]                                                         # [B, S, N]

    if cut:
        return jnp.einsum("bsdn,bsn->bsd", dbx, c)

    def step(h, inputs):
        da_t, dbx_t, c_t = inputs
        h = da_t * h + dbx_t
        return h, jnp.einsum("bdn,bn->bd", h, c_t)

    xs = tuple(jnp.moveaxis(v, 1, 0) for v in (da, dbx, c))
    _, y = lax.scan(step, jnp.zeros(da.shape[:1] + da.shape[2:]), xs)
    return jnp.moveaxis(y, 0, 1)


def _heads(x, w):
    b, s, _ = x.shape
    return (x @ w).reshape(b, s, HEADS, -1)


def linear_attention(p, x, cut=False):
    q, k, v = (jax.nn.elu(_heads(x, p[w])) + 1 if w != "v" else _heads(x, p[w])
               for w in ("q", "k", "v"))
    kv, z = k[..., :, None] * v[..., None, :], k                           # [B, S, H, d, d]
    if not cut:
        kv, z = jnp.cumsum(kv, axis=1), jnp.cumsum(z, axis=1)
    out = jnp.einsum("bshd,bshde->bshe", q, kv) / jnp.einsum("bshd,bshd->bsh", q, z)[..., None]
    return out.reshape(x.shape) @ p["o"]


def gla(p, x, cut=False):
    b, s, dim = x.shape
    q, k, v = (_heads(x, p[w]) for w in ("q", "k", "v"))
    g = jax.nn.log_sigmoid(_heads(x, p["g"])) / 16                         # log decays
    n = s // CHUNK

    def chunks(t):                                                         # [n, B, C, H, d]
        return jnp.moveaxis(t.reshape(b, n, CHUNK, HEADS, -1), 1, 0)

    causal = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))

    def step(state, inputs):
        q_c, k_c, v_c, g_c = inputs
        decay = jnp.cumsum(g_c, axis=1)                                    # [B, C, H, d]
        last = decay[:, -1:]
        qd, kd = q_c * jnp.exp(decay), k_c * jnp.exp(-decay)
        inner = jnp.einsum("bqhd,bkhd->bhqk", qd, kd) * causal
        out = jnp.einsum("bhqk,bkhe->bqhe", inner, v_c) \
            + jnp.einsum("bqhd,bhde->bqhe", qd, state)
        state = jnp.exp(last[:, 0])[..., None] * state \
            + jnp.einsum("bkhd,bkhe->bhde", k_c * jnp.exp(last - decay), v_c)
        return state, out

    state = jnp.zeros((b, HEADS, dim // HEADS, dim // HEADS))
    inputs = tuple(chunks(t) for t in (q, k, v, g))
    if cut:
        out = jax.vmap(lambda *c: step(state, c)[1])(*inputs)
    else:
        _, out = lax.scan(step, state, inputs)
    return jnp.moveaxis(out, 0, 1).reshape(b, s, dim) @ p["o"]


def rg_lru(p, x, cut=False):
    r = jax.nn.sigmoid(x @ p["a"])
    log_a = -8.0 * r * jax.nn.softplus(p["lam"])
    a = jnp.exp(log_a)
    b = jnp.sqrt(1 - jnp.exp(2 * log_a)) * jax.nn.sigmoid(x @ p["i"]) * x
    if cut:
        return a * b

    def combine(left, right):
        return left[0] * right[0], right[0] * left[1] + right[1]

    return lax.associative_scan(combine, (a, b), axis=1)[1]


def deltanet(p, x, cut=False):
    q, k, v = (_heads(x, p[w]) for w in ("q", "k", "v"))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(x @ p["g"])                                      # [B, S, H]

    def step(state, inputs):
        q_t, k_t, v_t, b_t = inputs
        error = jnp.einsum("bhk,bhkv->bhv", k_t, state) - v_t
        state = state - jnp.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, error)
        return state, jnp.einsum("bhk,bhkv->bhv", q_t, state)

    d = x.shape[-1] // HEADS
    state = jnp.zeros((x.shape[0], HEADS, d, d))
    inputs = tuple(jnp.moveaxis(t, 1, 0) for t in (q, k, v, beta))
    if cut:
        out = jax.vmap(lambda *t: step(state, t)[1])(*inputs)
    else:
        _, out = lax.scan(step, state, inputs)
    return jnp.moveaxis(out, 0, 1).reshape(x.shape) @ p["o"]


def ema(p, x, cut=False):
    alpha = 1 - 0.01 * jax.nn.sigmoid(x @ p["a"])                          # decay in (0.99, 1)
    if cut:
        return (1 - alpha) * x
    decay = jnp.cumprod(alpha, axis=1)
    return decay * jnp.cumsum((1 - alpha) * x / decay, axis=1)


def gru(p, x, cut=False):
    def step(h, x_t):
        z = jax.nn.sigmoid(x_t @ p["wz"] + h @ p["uz"])
        r = jax.nn.sigmoid(x_t @ p["wr"] + h @ p["ur"])
        h = (1 - z) * h + z * jnp.tanh(x_t @ p["wh"] + (r * h) @ p["uh"])
        return h, h

    h = jnp.zeros_like(x[:, 0])
    if cut:
        return jax.vmap(lambda x_t: step(h, x_t)[1], 1, 1)(x)
    _, out = lax.scan(step, h, jnp.moveaxis(x, 1, 0))
    return jnp.moveaxis(out, 0, 1)


def token_wise(p, x, cut=False):
    """The control: a token-wise op in a recurrence's place."""
    return jnp.tanh(x @ p["o"])


LAYERS = {"mamba": mamba, "linear_attention": linear_attention, "gla": gla,
          "rg_lru": rg_lru, "deltanet": deltanet, "ema": ema, "gru": gru}


def attention(p, x):
    b, s, dim = x.shape
    q, k, v = (_heads(x, p[w]) for w in ("q", "k", "v"))
    return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, dim) @ p["o"]


def rms(x):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def hybrid_block(layer, cut=False):
    """``loss(params, x)`` of one block: ``layer`` (its ``cut`` twin) then a causal
    attention, residual."""
    def loss(params, x):
        h = x + layer(params["mix"], rms(x), cut)
        h = h + attention(params["attn"], rms(h))
        return jnp.mean(jnp.tanh(h) ** 2)
    return loss


def block_params(name: str, key, dim: int) -> dict:
    """Parameters of :func:`hybrid_block` with layer ``name`` (``token_wise``: the control)."""
    k1, k2 = jax.random.split(key)
    mix = init("linear_attention" if name == "token_wise" else name, k1, dim)
    return {"mix": mix, "attn": init("linear_attention", k2, dim)}
