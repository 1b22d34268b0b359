"""Images and video: a sequence made of several dims (frames × patches), attended one dim
at a time (factorised space-time attention) or merged, against the undecorated function."""
import math
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_rewritten, assert_tree_close, make_mesh, sharded_only
from cptransform import context_parallel
from cptransform.ir.errors import SeqAxisError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import video_dit  # noqa: E402

B, FRAMES, PATCHES, C = 2, 16, 16, 32
#: Ulysses needs the heads to divide over the 8 devices; the other schedules take 4.
SCHEDULES = [("auto", "auto", 4), ("ring", "zigzag", 4), ("ulysses", "none", 8)]


def rotate(x, cos, sin):
    """RoPE of ``x [N, L, ..., D]`` along dim 1 with ``cos``/``sin`` ``[L, D/2]``."""
    shape = (1, cos.shape[0]) + (1,) * (x.ndim - 3) + (cos.shape[1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def cos_sin(n: int, d: int):
    inv = 10000.0 ** (-jnp.arange(d // 2, dtype=jnp.float32) / (d // 2))
    angles = jnp.arange(n, dtype=jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def space_time_loss(params, x, heads: int = 4):
    """Factorised space-time attention on ``x [B, T, P, C]``: per layer, spatial attention
    within each frame, then temporal attention across the frames of each patch, both as
    5-D einsums; q and k get the patches' RoPE through a reshape to ``[B·T, P, H, D]`` and
    back (frames merged with the batch), as video models write it."""
    b, t, p, c = x.shape
    d = c // heads
    cos, sin = cos_sin(p, d)

    def qkv(w, h):
        q, k, v = (jnp.einsum("btpc,chd->btphd", h, w[n].reshape(c, heads, d)) for n in "qkv")
        q, k = (rotate(a.reshape(b * t, p, heads, d), cos, sin).reshape(a.shape)
                for a in (q, k))
        return q, k, v

    for w in params:
        q, k, v = qkv(w["space"], x)
        s = jnp.einsum("btqhd,btkhd->bthqk", q, k) / math.sqrt(d)
        o = jnp.einsum("bthqk,btkhd->btqhd", jax.nn.softmax(s, -1), v)
        x = x + o.reshape(b, t, p, c) @ w["space"]["o"]
        q, k, v = qkv(w["time"], x)
        s = jnp.einsum("bqphd,bkphd->bphqk", q, k) / math.sqrt(d)
        o = jnp.einsum("bphqk,bkphd->bqphd", jax.nn.softmax(s, -1), v)
        x = x + o.reshape(b, t, p, c) @ w["time"]["o"]
    return jnp.mean(jnp.sin(x) * x)


def space_time_args(rng, layers: int = 1):
    def weights():
        return {n: jnp.asarray(rng.standard_normal((C, C)) / math.sqrt(C), jnp.float32)
                for n in "qkvo"}
    params = [{"space": weights(), "time": weights()} for _ in range(layers)]
    return params, normal(rng, B, FRAMES, PATCHES, C)


def normal(rng, *shape, scale: float = 1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def check(loss, args, count: int, argnums=0, **options):
    """Loss and gradients of ``loss`` under ``context_parallel(cp=8, **options)`` equal
    the undecorated function's, with ``count`` attentions rewritten."""
    f = context_parallel(loss, cp=8, **options)
    with sharded_only():
        assert_rewritten(f, *args, count=count)
        got = jax.value_and_grad(f, argnums=argnums)(*args)
    assert_tree_close(got, jax.value_and_grad(loss, argnums=argnums)(*args))
    return f


@pytest.mark.parametrize("load_balance", [
    "zigzag", pytest.param("striped", marks=pytest.mark.slow),
    pytest.param("none", marks=pytest.mark.slow)])
def test_factorised_space_time_attention_is_exact(rng, load_balance):
    """The frames of k, merged with the batch around its RoPE and split back, keep the
    order of q's frames (a silent wrong answer under zigzag and striped once: loss off by
    5e-2, gradients by 0.99)."""
    check(space_time_loss, space_time_args(rng), 2, argnums=(0, 1), schedule="ring",
          load_balance=load_balance)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance,heads", SCHEDULES)
def test_factorised_space_time_attention_under_every_schedule(rng, schedule, load_balance,
                                                              heads):
    loss = lambda p, x: space_time_loss(p, x, heads)  # noqa: E731
    check(loss, space_time_args(rng), 2, argnums=(0, 1), schedule=schedule,
          load_balance=load_balance)



@pytest.mark.slow
def test_factorised_attention_under_the_models_own_constraint(rng):
    """A model's constraint on ``[B, T, P, C]`` (its batch over 'data'): the CP axis goes
    on the sharded sequence's dim alone (frames and patches are both sequences of that
    value; both on 'cp' was a duplicate-axis error)."""
    mesh = make_mesh((2, 4), ("data", "cp"))

    def loss(params, x):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data", None, None, None)))
        return space_time_loss(params, x)

    args = space_time_args(rng)
    f = context_parallel(loss, mesh=mesh, axis="cp", schedule="ring", load_balance="zigzag")
    with sharded_only():
        assert_rewritten(f, *args, count=2)
        got = jax.value_and_grad(f, argnums=(0, 1))(*args)
    assert_tree_close(got, jax.value_and_grad(loss, argnums=(0, 1))(*args))

# -- ViT: a conv patch embedding, axial 2-D RoPE ---------------------------------------------

def axial_rope(x, rows: int, cols: int):
    """2-D RoPE of ``x [B, rows·cols, H, D]``: half the frequencies rotate by the row of
    each patch, half by its column (positions from ``jnp.meshgrid`` of ``jnp.arange``s)."""
    quarter = x.shape[-1] // 4
    inv = 10000.0 ** (-jnp.arange(quarter, dtype=jnp.float32) / quarter)
    r, c = jnp.meshgrid(jnp.arange(rows), jnp.arange(cols), indexing="ij")
    angles = jnp.concatenate([r[..., None] * inv, c[..., None] * inv], -1)
    angles = angles.reshape(rows * cols, 2 * quarter)[None, :, None, :]
    return rotate_halves(x, angles)


def rotate_halves(x, angles):
    half = x.shape[-1] // 2
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6)


def encoder_layer(x, w, heads: int, rope):
    b, s, c = x.shape
    d = c // heads
    h = layer_norm(x)
    q, k, v = ((h @ w[n]).reshape(b, s, heads, d) for n in "qkv")
    q, k = rope(q), rope(k)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v).reshape(b, s, c)
    x = x + o @ w["o"]
    return x + jnp.tanh(layer_norm(x) @ w["m1"]) @ w["m2"]


def vit_loss(params, images, labels, heads: int = 4, patch: int = 4):
    """A ViT classifier: a strided conv patch embedding of ``images [B, H, W, 3]``, its
    ``[B, H/p, W/p, C]`` patches flattened into tokens, encoder layers with axial 2-D RoPE,
    mean pooling, cross-entropy."""
    e = lax.conv_general_dilated(images, params["patch"], (patch, patch), "VALID",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    b, rows, cols, c = e.shape
    x = e.reshape(b, rows * cols, c)
    for w in params["layers"]:
        x = encoder_layer(x, w, heads, lambda t: axial_rope(t, rows, cols))
    logp = jax.nn.log_softmax(x.mean(1) @ params["head"])
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def vit_args(rng, size: int = 32, patch: int = 4, layers: int = 2):
    def layer():
        return {**{n: normal(rng, C, C, scale=C ** -0.5) for n in "qkvo"},
                "m1": normal(rng, C, 2 * C, scale=C ** -0.5),
                "m2": normal(rng, 2 * C, C, scale=(2 * C) ** -0.5)}
    params = {"patch": normal(rng, patch, patch, 3, C, scale=0.2),
              "layers": [layer() for _ in range(layers)], "head": normal(rng, C, 10, scale=0.2)}
    labels = jnp.asarray(rng.integers(0, 10, (B,)), jnp.int32)
    return params, normal(rng, B, size, size, 3), labels


@pytest.mark.slow  # the fast tier's 2-D patches: test_image_rows_and_columns_in_patches_...
@pytest.mark.parametrize("schedule,load_balance,heads", SCHEDULES)
def test_vit_conv_patches_and_axial_rope(rng, schedule, load_balance, heads):
    """The sequence starts at the patch embedding (no input carries it: every device reads
    the image); every attention is sharded and the numbers are one device's."""
    loss = lambda p, x, y: vit_loss(p, x, y, heads)  # noqa: E731
    args = vit_args(rng)
    f = check(loss, args, 2, schedule=schedule, load_balance=load_balance)
    assert "the sequence starts at conv_general_dilated" in f.explain(*args)


def patchified_vit_loss(params, images, labels, patch: int = 4):
    """The ViT with its patches cut by a reshape instead of a conv."""
    b, h, w, _ = images.shape
    rows, cols = h // patch, w // patch
    x = images.reshape(b, rows, patch, cols, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(b, rows * cols, patch * patch * 3) @ params["patch"].reshape(-1, C)
    for w_ in params["layers"]:
        x = encoder_layer(x, w_, 4, lambda t: axial_rope(t, rows, cols))
    logp = jax.nn.log_softmax(x.mean(1) @ params["head"])
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def test_image_rows_and_columns_in_patches_are_the_sequence(rng):
    """Patches cut by a reshape: the image's rows and columns, in patches, are the
    sequence, sharded on the rows (each device holds whole rows of patches)."""
    args = vit_args(rng)
    f = check(patchified_vit_loss, args, 2, schedule="ring", load_balance="zigzag")
    assert ("args[1] dims (1, 2) merged in patches of 4x4, sharded on dim 1"
            in f.explain(*args))


# -- DiT: a video latent, 3-D RoPE, adaLN-zero ------------------------------------------------

DIT = video_dit.Config(frames=8, height=8, width=8, dim=48, heads=8, layers=1, mlp_dim=64)


@pytest.mark.slow  # the fast tier traces and plans it: test_video_dit_explain_names_...
@pytest.mark.parametrize("schedule,load_balance", [("auto", "auto"), ("ring", "zigzag"),
                                                   ("ulysses", "none")])
def test_video_dit(schedule, load_balance):
    """The example's DiT: frames × rows × columns of patches merged into the sequence of
    a full attention, exact and sharded under each schedule."""
    cfg = replace(DIT, heads=8 if schedule == "ulysses" else 4)
    loss = lambda p, x, n, t: video_dit.loss(p, x, n, t, cfg)  # noqa: E731
    check(loss, video_dit.example_args(cfg), cfg.layers, schedule=schedule,
          load_balance=load_balance)


def test_video_dit_explain_names_the_merged_dims_and_the_sharded_one():
    loss = lambda p, x, n, t: video_dit.loss(p, x, n, t, DIT)  # noqa: E731
    text = context_parallel(loss, cp=8).explain(*video_dit.example_args(DIT))
    assert ("args[1] dims (1, 2, 3) merged in patches of 1x2x2, sharded on dim 1"
            in text), text


def flat_dit_loss(params, tokens, frames: int = 8, heads: int = 4):
    """A DiT handed pre-flattened latent tokens ``[B, T·P, C]``: a per-frame embedding is
    added on the ``[B, T, P, C]`` view, then full attention over all ``T·P`` tokens."""
    b, s, c = tokens.shape
    x = tokens.reshape(b, frames, s // frames, c) + params["frame"][None, :, None, :]
    x = x.reshape(b, s, c)
    for w in params["layers"]:
        x = encoder_layer(x, w, heads, lambda t: t)
    return jnp.mean(jnp.tanh(x) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance,heads", SCHEDULES)
def test_dit_on_pre_flattened_latents(rng, schedule, load_balance, heads):
    """The tokens' dim reaches the attention through the ``[B, T, P, C]`` view (a split and
    a merge): the input is the sequence, no ``seq_axes`` needed."""
    params, _, _ = vit_args(rng, layers=1)
    params["frame"] = normal(rng, 8, C)
    args = (params, normal(rng, B, 8 * 16, C))
    loss = lambda p, x: flat_dit_loss(p, x, heads=heads)  # noqa: E731
    f = check(loss, args, 1, schedule=schedule, load_balance=load_balance)
    assert f.module(*args).facts.seq_axes.inputs[-1] == (1,)


# -- seq_axes= with merged dims -----------------------------------------------------------

def grid_loss(params, grid):
    """Tokens handed over as a grid ``[B, H, W, C]`` flattened inside."""
    b, h, w, c = grid.shape
    x = grid.reshape(b, h * w, c)
    for layer in params["layers"]:
        x = encoder_layer(x, layer, 4, lambda t: t)
    return jnp.mean(x ** 2)


def test_seq_axes_takes_merged_dims(rng):
    """``seq_axes=(None, ((1, 2),))`` names the grid's rows and columns merged: what
    inference finds; a merged pair of the wrong length is refused."""
    params, _, _ = vit_args(rng, layers=1)
    args = (params, normal(rng, B, 8, 8, C))
    inferred = context_parallel(grid_loss, cp=8).module(*args).facts.seq_axes.inputs[-1]
    assert inferred == (((1, 1), (2, 1)),)
    f = check(grid_loss, args, 1, schedule="ring", seq_axes=(None, ((1, 2),)))
    assert f.module(*args).facts.seq_axes.inputs[-1] == inferred
    with pytest.raises(SeqAxisError, match=r"dims \(2, 3\) merged"):
        context_parallel(grid_loss, cp=8, seq_axes=(None, ((2, 3),))).module(*args)


# -- factorised attention planned as one model ---------------------------------------------

def test_factorised_attention_shards_one_sequence_and_runs_the_other_locally(rng):
    """Frames × patches in one value: the planner shards one of the two sequences; the
    attention whose batch holds it runs on each device's own part with no communication
    (``local``), the other runs its schedule; explain says which and why. The compiled
    program moves nothing by all-to-all (each layer's spatial attention once moved q, k,
    v and o between the two shardings, forward and backward)."""
    args = space_time_args(rng)
    f = check(space_time_loss, args, 2, argnums=(0, 1), schedule="ring", load_balance="none")
    module = f.module(*args)
    sharded = module.facts.sharded_sequence
    assert sorted(p.schedule for p in module.facts.plan) == ["local", "ring"]
    assert sharded is not None and len(sharded.local) == 1
    text = f.explain(*args)
    assert "sharded sequence: sequence" in text and "schedule: local — its batch dim" in text
    hlo = jax.jit(jax.value_and_grad(f)).lower(*args).compile().as_text()
    assert "all-to-all(" not in hlo and "all-gather(" not in hlo


def test_choosing_the_sharded_sequence():
    from cptransform.analysis.sharded_sequence import AttentionAxes, choose

    space, time = AttentionAxes(own=1, batch={0: 1}), AttentionAxes(own=0, batch={1: 2})
    # Sharding sequence 0 runs the spatial attention locally: 1 + 5 (its compute) beats
    # 4 (its schedule) + 3 (the temporal attention's compute).
    picked = choose([space, time], time_s=[4.0, 1.0], compute_s=[1.0, 3.0],
                    move_s=[9.0, 9.0], lengths=(16, 16))
    assert picked.sequence == 0 and picked.local == (0,)
    assert [c.time_s for c in picked.choices] == [2.0, 7.0]
    # An attention whose batch holds neither sequence it is not along is moved.
    other = AttentionAxes(own=1, batch={})
    picked = choose([space, time, other], time_s=[4.0, 1.0, 1.0],
                    compute_s=[1.0, 3.0, 0.5], move_s=[9.0, 9.0, 2.0], lengths=(16, 16))
    assert (picked.sequence, picked.choices[0].moved, picked.choices[0].time_s) == \
        (0, (2,), 5.0)
    assert choose([AttentionAxes(own=0, batch={})], [1.0], [1.0], [1.0], (16,)) is None
