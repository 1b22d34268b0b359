"""Context parallelism inside models already written for sharding (docs/sharded_models.md).

Five spellings of one decoder block, each annotating its activations for its own mesh the
way production code does, on three meshes of 8 devices that put the CP axis beside the
model's axes: Flax linen's ``with_logical_constraint`` under ``logical_axis_rules``, an NNX
model whose parameters carry sharding metadata (constrained by ``get_partition_spec``),
explicit ``with_sharding_constraint`` on q/k/v/o and the MLP (EasyDeL's pattern), an MoE
layer under ``shard_map`` calling ``axis_index``/``psum`` over the model's axis, and
single-device model code constraining on a 1-device mesh. Values and gradients match the
same model on one device, the attention is sharded, and the lowered program keeps the
model's own axes on the non-CP dims with the CP axis on the sequence.
"""
from __future__ import annotations

import contextlib
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_rewritten, assert_tree_close, make_mesh
from cptransform import PartlyShardedWarning, UnshardedError, context_parallel
from cptransform.ir.errors import ContextParallelError

B, S, H, D, F = 2, 64, 4, 8, 32
E = H * D
MESHES = {"data_cp": ((2, 4), ("data", "cp")),
          "fsdp_tensor_cp": ((2, 2, 2), ("fsdp", "tensor", "cp")),
          "expert_cp": ((2, 4), ("expert", "cp"))}


def _roles(mesh) -> dict:
    """Which of the mesh's axes shards the batch, the heads and MLP features, the experts
    (``None``: not on this mesh)."""
    names = mesh.axis_names
    batch = next((a for a in ("data", "fsdp", "expert") if a in names), None)
    return {"batch": batch, "heads": "tensor" if "tensor" in names else None,
            "expert": next(a for a in names if a != "cp")}


def _causal(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _weights(seed=0) -> dict:
    rng = np.random.default_rng(seed)
    w = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)  # noqa: E731
    return {"wq": w(E, H, D), "wk": w(E, H, D), "wv": w(E, H, D), "wo": w(H, D, E),
            "up": w(E, F), "down": w(F, E), "experts": w(2, E, E)}


def _tokens(seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, S, E)), jnp.float32)


def explicit(mesh):
    """EasyDeL's pattern: q, k, v, the attention output and the MLP activation each
    constrained with a NamedSharding on the model's mesh."""
    r = _roles(mesh)

    def c(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def loss(p, x):
        q, k, v = (c(jnp.einsum("bse,ehd->bshd", x, p[n]), r["batch"], None, r["heads"], None)
                   for n in ("wq", "wk", "wv"))
        o = c(_causal(q, k, v), r["batch"], None, r["heads"], None)
        x = x + jnp.einsum("bshd,hde->bse", o, p["wo"])
        h = c(jax.nn.gelu(x @ p["up"]), r["batch"], None, r["heads"])
        return jnp.mean((x + h @ p["down"]) ** 2)
    return loss, _weights(), contextlib.nullcontext()


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        c = nn.with_logical_constraint
        # No key bias: the softmax cancels it, its gradient is rounding noise.
        q, k, v = (c(nn.DenseGeneral((H, D), use_bias=False, name=n)(x),
                     ("batch", "length", "heads", "kv")) for n in "qkv")
        o = c(_causal(q, k, v), ("batch", "length", "heads", "kv"))
        x = x + nn.DenseGeneral(E, axis=(-2, -1), name="o")(o)
        h = c(nn.gelu(nn.Dense(F, name="up")(x)), ("batch", "length", "mlp"))
        return jnp.mean((x + nn.Dense(E, name="down")(h)) ** 2)


def _rules(mesh):
    r = _roles(mesh)
    return (("batch", r["batch"]), ("length", None), ("heads", r["heads"]), ("kv", None),
            ("mlp", r["heads"]), ("embed", r["batch"]))


def linen(mesh):
    """Flax linen: logical axis names resolved by ``logical_axis_rules`` to mesh axes."""
    model = _LinenBlock()
    params = jax.device_get(model.init(jax.random.key(0), _tokens()))
    return model.apply, params, _under(mesh, nn.logical_axis_rules(_rules(mesh)))


def _under(mesh, rules):
    """The model's context: its mesh set (Flax's constraints resolve against it) and its
    logical axis rules; on one device the rules alone (the constraints are no-ops)."""
    stack = contextlib.ExitStack()
    if mesh.size > 1:
        stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(rules)
    return stack


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        part = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        self.q, self.k, self.v = (nnx.LinearGeneral(E, (H, D), use_bias=False, rngs=rngs,
                                                    kernel_init=part("embed", "heads", "kv"))
                                  for _ in range(3))
        self.o = nnx.LinearGeneral((H, D), E, axis=(-2, -1),
                                   kernel_init=part("heads", "kv", "embed"), rngs=rngs)
        self.up = nnx.Linear(E, F, kernel_init=part("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(F, E, kernel_init=part("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        o = _causal(self.q(x), self.k(x), self.v(x))
        x = x + self.o(o)
        return jnp.mean((x + self.down(nnx.gelu(self.up(x)))) ** 2)


def nnx_metadata(mesh):
    """Flax NNX: parameters with sharding metadata, constrained to their partition specs
    inside the loss (NNX's sharded-model idiom), logical names resolved by the rules."""
    # NNX shards variables with metadata as it creates them: on the model's mesh.
    with jax.set_mesh(mesh), nnx.logical_axis_rules(_rules(mesh)):
        graphdef, state = nnx.split(_NnxBlock(nnx.Rngs(0)))
    state = jax.device_get(state)

    def loss(state, x):
        state = jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state))
        return nnx.merge(graphdef, state)(x)
    return loss, state, _under(mesh, nnx.logical_axis_rules(_rules(mesh)))


def moe(mesh):
    """An MoE layer under ``shard_map`` over the model's axis: each shard runs its expert
    on every token (``axis_index`` picks its gate), ``psum`` combines them."""
    ep = _roles(mesh)["expert"]

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(ep)), out_specs=P(), check_vma=False)
    def experts(tokens, w):
        gate = jax.nn.sigmoid(tokens[:, :1] + jax.lax.axis_index(ep).astype(tokens.dtype))
        return jax.lax.psum(gate * jnp.tanh(tokens @ w[0]), ep)

    if mesh.size == 1:
        def experts(tokens, w):  # the same layer on one device, experts in a loop
            return sum(jax.nn.sigmoid(tokens[:, :1] + i) * jnp.tanh(tokens @ w[i])
                       for i in range(w.shape[0]))

    def loss(p, x):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, p[n]) for n in ("wq", "wk", "wv"))
        x = x + jnp.einsum("bshd,hde->bse", _causal(q, k, v), p["wo"])
        y = experts(x.reshape(B * S, E), p["experts"]).reshape(B, S, E)
        return jnp.mean((x + y) ** 2)
    return loss, _weights(), contextlib.nullcontext()


def one_device(mesh):
    """Single-device model code: the constraints name a 1-device mesh of the model's axes."""
    return explicit(_single(mesh))


def _single(mesh):
    return make_mesh((1,) * len(mesh.axis_names), mesh.axis_names)


SPELLINGS = {"explicit": explicit, "linen": linen, "nnx": nnx_metadata, "moe": moe,
             "one_device": one_device}
#: The fast tier's sample; the rest of the matrix is slow.
FAST = {("explicit", "fsdp_tensor_cp"), ("moe", "expert_cp")}


def _cases():
    return [pytest.param(s, m, marks=() if (s, m) in FAST else pytest.mark.slow)
            for s in SPELLINGS for m in MESHES]


@pytest.mark.parametrize("spelling,mesh_name", _cases())
def test_sharded_model_exact_and_keeps_its_shardings(spelling, mesh_name):
    mesh = make_mesh(*MESHES[mesh_name])
    loss, params, rules = SPELLINGS[spelling](mesh)
    ref_loss, _, ref_rules = SPELLINGS[spelling](_single(mesh))
    x = _tokens()
    with ref_rules:
        expected = jax.value_and_grad(ref_loss)(params, x)
    with rules:
        f = context_parallel(loss, mesh=mesh, axis="cp", schedule="ring", load_balance="zigzag")
        got = jax.value_and_grad(f)(params, x)
        assert_rewritten(f, params, x, count=1)
        lowered = jax.jit(jax.value_and_grad(f)).lower(params, x)
        text, compiled = lowered.as_text(), lowered.compile().as_text()
    assert_tree_close(jax.device_get(got), jax.device_get(expected), rtol=2e-5)
    r = _roles(mesh)
    if spelling == "moe":
        # The experts' weights stay split over the model's axis inside the shard_map.
        want = f'in_shardings=[<@mesh, [{{}}, {{}}]>, <@mesh, [{{"{r["expert"]}"}}, {{}}, {{}}]>]'
        assert want in text, f"no shard_map with {want} in the lowered program"
        return
    kept = lambda a: "{}" if a is None or spelling == "one_device" else f'{{"{a}"}}'  # noqa: E731
    want = f'<@mesh, [{kept(r["batch"])}, {{"cp"}}, {kept(r["heads"])}, {{}}]> : ' \
           f'tensor<{B}x{S}x{H}x{D}xf32>'
    if spelling == "nnx":  # NNX constrains its parameters: q's kernel [embed, heads, kv]
        want = f'<@mesh, [{kept(r["batch"])}, {kept(r["heads"])}, {{}}]> : tensor<{E}x{H}x{D}xf32>'
    assert want in text, f"no constraint {want} in the lowered program"
    # The compiled (partitioned) program holds each device's part: q split over the batch
    # (or, for NNX, q's kernel over the embedding) and heads axes as well as over cp.
    size = dict(zip(mesh.axis_names, mesh.devices.shape))
    part = lambda a: 1 if a is None or spelling == "one_device" else size[a]  # noqa: E731
    local = f"f32[{E // part(r['batch'])},{H // part(r['heads'])},{D}]" if spelling == "nnx" \
        else f"f32[{B // part(r['batch'])},{S // size['cp']},{H // part(r['heads'])},{D}]"
    assert local in compiled, f"no per-device {local} in the compiled program"


def test_auto_schedule_keeps_the_model_axes():
    """Under schedule=auto and load_balance=auto too (fast: the EasyDeL pattern)."""
    mesh = make_mesh(*MESHES["data_cp"])
    loss, params, _ = explicit(mesh)
    x = _tokens()
    expected = jax.value_and_grad(explicit(_single(mesh))[0])(params, x)
    f = context_parallel(loss, mesh=mesh, axis="cp")
    assert_tree_close(jax.device_get(jax.value_and_grad(f)(params, x)), jax.device_get(expected),
                      rtol=2e-5)
    assert_rewritten(f, params, x, count=1)


def test_constraint_on_an_axis_the_program_lacks_is_refused():
    model_mesh = make_mesh((8,), ("dp",))

    def loss(p, x):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(model_mesh, P("dp")))
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, p[n]) for n in ("wq", "wk", "wv"))
        return jnp.mean(_causal(q, k, v) ** 2)
    f = context_parallel(loss, mesh=make_mesh(*MESHES["data_cp"]), axis="cp")
    with pytest.raises(ContextParallelError, match="names mesh axis 'dp' of size 8, which "
                       "the program's mesh {'data': 2, 'cp': 4} does not have"):
        f(_weights(), _tokens())


def test_the_cp_axis_on_a_dim_other_than_the_sequence_is_refused():
    mesh = make_mesh(*MESHES["data_cp"])

    def loss(p, x):
        q, k, v = (jax.lax.with_sharding_constraint(
            jnp.einsum("bse,ehd->bshd", x, p[n]), NamedSharding(mesh, P(None, None, "cp")))
            for n in ("wq", "wk", "wv"))
        return jnp.mean(_causal(q, k, v) ** 2)
    f = context_parallel(loss, mesh=mesh, axis="cp")
    with pytest.raises(ContextParallelError, match="shards dim 2 over the CP axis 'cp'"):
        f(_weights(), _tokens())


def test_shard_map_on_another_mesh_is_refused():
    loss, params, _ = moe(make_mesh((2, 4), ("expert", "ep2")))
    f = context_parallel(loss, mesh=make_mesh(*MESHES["expert_cp"]), axis="cp")
    with pytest.raises(ContextParallelError, match="runs on mesh .* but the program's mesh is"):
        f(params, _tokens())


def _labelled(place):
    """EasyDeL's labels on a single-device model: the block's input named for remat
    (``checkpoint_name``) and placed by ``device_put`` on ``place``."""
    def loss(p, x):
        h = jax.device_put(checkpoint_name(x, "block_in"), place)
        q, k, v = (jnp.einsum("bse,ehd->bshd", h, p[n]) for n in ("wq", "wk", "wv"))
        return jnp.mean(_causal(q, k, v) ** 2)
    return loss


def test_checkpoint_name_and_device_put_carry_the_sequence():
    """``checkpoint_name`` and a ``device_put`` onto a 1-device mesh of the model's axes
    carry the sequence like an identity (without their rows in the primitive table no input
    reaches the attention's sequence axis) and the placement is re-expressed on the CP
    mesh."""
    one = make_mesh((1, 1), ("data", "tensor"))
    loss = _labelled(NamedSharding(one, P("data")))
    params, x = _weights(), _tokens()
    expected = jax.value_and_grad(loss)(params, x)
    f = context_parallel(loss, mesh=make_mesh(*MESHES["data_cp"]), axis="cp",
                         schedule="ring", load_balance="zigzag")
    assert_tree_close(jax.device_get(jax.value_and_grad(f)(params, x)),
                      jax.device_get(expected), rtol=2e-5)
    assert_rewritten(f, params, x, count=1)


def test_device_put_on_a_device_is_refused():
    loss = _labelled(jax.devices()[0])
    f = context_parallel(loss, mesh=make_mesh(*MESHES["data_cp"]), axis="cp")
    with pytest.raises(ContextParallelError, match="places a value on .*, not on a mesh's "
                       "device memory"):
        f(_weights(), _tokens())


@jax.custom_vjp
def _gathered(x, idx):
    return x[idx]


_gathered.defvjp(lambda x, idx: (x[idx], (idx, x.shape)),
                 lambda res, g: (jnp.zeros(res[1], g.dtype).at[res[0]].add(g), None))


def test_one_device_shard_map_the_program_mesh_rejects_is_refused():
    """A shard_map on a 1-device mesh whose body sorts tokens through a custom_vjp gather
    (EasyDeL's fused MoE): moved onto the program's mesh, its body keeps the 1-device
    mesh in its types and JAX rejects it; refused, naming the shard_map and the fix."""
    mesh = make_mesh(*MESHES["expert_cp"])

    @partial(jax.shard_map, mesh=_single(mesh), in_specs=(P(), P()), out_specs=P(),
             check_vma=False)
    def mix(t, w):
        return _gathered(t, jnp.argsort(t[:, 0])) @ w[0]

    def loss(p, x):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, p[n]) for n in ("wq", "wk", "wv"))
        return jnp.mean(mix(_causal(q, k, v).reshape(B * S, E), p["experts"]) ** 2)
    f = context_parallel(loss, mesh=mesh, axis="cp")
    with pytest.raises(NotImplementedError, match="runs on the 1-device mesh .*; moved onto "
                       "the program's mesh .* its body is rejected by JAX"):
        jax.value_and_grad(f)(_weights(), _tokens())


def _attention_in_shard_map(also_outside: bool):
    mesh = make_mesh(*MESHES["data_cp"])

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"),
             check_vma=False)
    def inner(q, k, v):
        return _causal(q, k, v)

    def loss(p, x):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, p[n]) for n in ("wq", "wk", "wv"))
        out = jnp.mean(inner(q, k, v) ** 2)
        return out + jnp.mean(_causal(q, k, v) ** 2) if also_outside else out
    return loss, mesh


def test_attention_inside_a_shard_map_is_reported_never_silent():
    """The rewrite never enters a model's shard_map body: an attention there runs whole on
    each device of the model's mesh. Alone it is refused (UnshardedError naming it);
    beside a sharded attention it is a PartlyShardedWarning, and the numbers still match
    one device."""
    where = "a softmax inside the shard_map at .*never rewritten"
    loss, mesh = _attention_in_shard_map(also_outside=False)
    with pytest.raises(UnshardedError, match=where):
        context_parallel(loss, mesh=mesh, axis="cp")(_weights(), _tokens())
    loss, mesh = _attention_in_shard_map(also_outside=True)
    params, x = _weights(), _tokens()
    f = context_parallel(loss, mesh=mesh, axis="cp", schedule="ring", load_balance="zigzag")
    with pytest.warns(PartlyShardedWarning, match=where):
        got = jax.value_and_grad(f)(params, x)
    ref_loss, _ = _attention_in_shard_map(also_outside=True)
    assert_tree_close(jax.device_get(got), jax.device_get(jax.value_and_grad(ref_loss)(params, x)),
                      rtol=2e-5)
    matches = f.module(params, x).facts.matches
    assert sum(m.rewritten for m in matches) == 1
    assert [m.runs_unsharded for m in matches if not m.rewritten] == [True]
