"""@context_parallel end to end: loss and every gradient equal the single-device run."""
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_rewritten, assert_tree_close, make_mesh
from cptransform import ContextParallelError, ContextParallelOptionError, context_parallel
from cptransform.analysis.primitives import Family, names_of
from cptransform.passes.plan_context_parallel import PlanError
from cptransform.passes.reorder_sequence import ReorderError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import llama  # noqa: E402

RTOL = 1e-5


@pytest.fixture(scope="module")
def llama_case():
    cfg = llama.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp_dim=64)
    params, tokens = llama.example_args(cfg, batch=2, seq=32, seed=1)
    loss = lambda p, t: llama.loss(p, t, cfg)  # noqa: E731
    ref = jax.jit(jax.value_and_grad(loss))(params, tokens)
    return loss, params, tokens, ref


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance,cp", [
    ("ring", "zigzag", 8), ("ring", "none", 4), ("ring", "striped", 2),
    ("ulysses", "zigzag", 4), ("ulysses", "none", 2), ("allgather", "striped", 4),
])
def test_llama_loss_and_grads(llama_case, schedule, load_balance, cp):
    loss, params, tokens, (ref_loss, ref_grads) = llama_case
    f = context_parallel(loss, cp=cp, schedule=schedule, load_balance=load_balance)
    assert_rewritten(f, params, tokens, count=1)
    value, grads = jax.jit(jax.value_and_grad(f))(params, tokens)
    np.testing.assert_allclose(value, ref_loss, rtol=RTOL)
    assert_tree_close(grads, ref_grads)


@pytest.mark.slow
def test_llama_hybrid(llama_case):
    loss, params, tokens, (ref_loss, ref_grads) = llama_case
    mesh = make_mesh((2, 4), ("uly", "ring"))
    f = context_parallel(loss, mesh=mesh, axis=("uly", "ring"))
    assert_rewritten(f, params, tokens, count=1)
    value, grads = jax.value_and_grad(f)(params, tokens)
    np.testing.assert_allclose(value, ref_loss, rtol=RTOL)
    assert_tree_close(grads, ref_grads)
    assert "hybrid" in f.explain(params, tokens)


@pytest.mark.slow
def test_sgd_step_matches(llama_case):
    loss, params, tokens, (_, ref_grads) = llama_case
    f = context_parallel(loss, cp=4)

    @jax.jit
    def step(p, t):
        g = jax.grad(f)(p, t)
        return jax.tree_util.tree_map(lambda w, d: w - 0.1 * d, p, g)

    new = step(params, tokens)
    expected = jax.tree_util.tree_map(lambda w, d: w - 0.1 * d, params, ref_grads)
    assert_tree_close(new, expected)
    assert float(f(new, tokens)) < float(f(params, tokens))


@pytest.mark.slow
def test_data_and_cp_mesh(llama_case):
    """A (data=2, cp=4) mesh: batch on data stays automatic, attention islands over cp."""
    loss, params, tokens, (ref_loss, ref_grads) = llama_case
    mesh = make_mesh((2, 4), ("data", "cp"))
    f = context_parallel(loss, mesh=mesh, axis="cp")
    assert_rewritten(f, params, tokens, count=1)
    sharded = jax.device_put(tokens, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data", None)))
    value, grads = jax.jit(jax.value_and_grad(f))(params, sharded)
    np.testing.assert_allclose(value, ref_loss, rtol=RTOL)
    assert_tree_close(grads, ref_grads)


def encoder(params, tokens, segments):
    """A bidirectional encoder layer with document (segment) masking via jax.nn."""
    x = params["embed"][tokens]
    b, s, d = x.shape
    q = (x @ params["wq"]).reshape(b, s, 4, d // 4)
    k = (x @ params["wk"]).reshape(b, s, 4, d // 4)
    v = (x @ params["wv"]).reshape(b, s, 4, d // 4)
    mask = segments[:, None, :, None] == segments[:, None, None, :]
    o = jax.nn.dot_product_attention(q, k, v, mask=mask).reshape(b, s, d)
    h = x + o @ params["wo"]
    return jnp.mean(jnp.tanh(h) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance", [("ring", "none"), ("ulysses", "striped"),
                                                   ("ring", "zigzag")])
def test_bidirectional_encoder(schedule, load_balance):
    keys = jax.random.split(jax.random.key(3), 6)
    d = 16
    params = {"embed": jax.random.normal(keys[0], (32, d)),
              **{n: jax.random.normal(k, (d, d)) / 4 for n, k in zip(("wq", "wk", "wv", "wo"),
                                                                      keys[1:5])}}
    tokens = jax.random.randint(keys[5], (2, 32), 0, 32)
    segments = jnp.cumsum(jax.random.bernoulli(keys[4], 0.15, (2, 32)), axis=1)
    ref_v, ref_g = jax.value_and_grad(encoder)(params, tokens, segments)
    f = context_parallel(encoder, cp=4, schedule=schedule, load_balance=load_balance)
    value, grads = jax.value_and_grad(f)(params, tokens, segments)
    np.testing.assert_allclose(value, ref_v, rtol=RTOL)
    assert_tree_close(grads, ref_g)


def test_explain_reads_well(llama_case):
    loss, params, tokens, _ = llama_case
    f = context_parallel(loss, cp=8)
    text = f.explain(params, tokens, verbose=True)
    (plan,) = f.module(params, tokens).facts.plan
    assert "attention #0 at" in text and "llama.py" in text
    # The fastest feasible schedule on the cpu-sim row (4 query heads rule Ulysses out).
    assert f"schedule: {plan.predictions[0].schedule} — least predicted time on cpu-sim" in text
    assert "excluded: ulysses: Ulysses splits the 4 query heads over cp=8" in text
    assert f"runner-up {plan.runner_up}" in text
    # Every legal layout is reported; the chosen one has the least predicted program time.
    balances = f.module(params, tokens).facts.balance
    (chosen,) = [b for b in balances if b.chosen]
    assert chosen.time_s <= 1.01 * min(b.time_s for b in balances)
    assert f"layout: {chosen.layout}" in text and f"{chosen.layout}: max/mean" in text
    assert re.search(r"zigzag: max/mean 1\.\d\dx", text) and "<- chosen" in text
    assert "sequence axis: length 32; inputs: args[1] dim [1]" in text


@pytest.mark.slow
def test_next_token_shift_stays_permuted(llama_case):
    """``logits[:, :-1]`` vs ``tokens[:, 1:]`` under zigzag: the small labels are re-aligned,
    the logits are never un-permuted."""
    loss, params, tokens, _ = llama_case
    text = context_parallel(loss, cp=4, load_balance="zigzag").explain(params, tokens)
    assert "re-align a sequence shifted by 1 (256 bytes gathered)" in text
    assert "un-permute" not in text


def cumulative_model(x):
    """Attention over a running sum along the sequence: not permutation-equivariant (a
    recurrence: state passed by default, gathered under ``recurrences="gather"``)."""
    h = jnp.cumsum(x, axis=1)
    return jnp.sum(jax.nn.dot_product_attention(h, x, x, is_causal=True) ** 2)


def sorted_model(x):
    """Attention over the tokens sorted along the sequence: not permutation-equivariant."""
    h = jnp.sort(x, axis=1)
    return jnp.sum(jax.nn.dot_product_attention(h, x, x, is_causal=True) ** 2)


@pytest.mark.slow
def test_positional_op_is_wrapped_or_refused():
    x = jax.random.normal(jax.random.key(5), (1, 32, 2, 8))
    f = context_parallel(sorted_model, cp=4, load_balance="zigzag")
    np.testing.assert_allclose(f(x), sorted_model(x), rtol=RTOL)
    assert re.search(r"sort at .*test_transform.py.* un-permute its operands first "
                     r"\(2048 bytes permuted\)", f.explain(x))
    strict = context_parallel(sorted_model, cp=4, load_balance="zigzag", strict=True)
    with pytest.raises(ReorderError, match="sort at .*strict=True"):
        strict(x)


def test_errors_name_the_fix(llama_case):
    loss, params, tokens, _ = llama_case
    with pytest.raises(ContextParallelOptionError, match="only 8 devices"):
        context_parallel(loss, cp=16)(params, tokens)
    with pytest.raises(ContextParallelOptionError, match="unknown option.*cpp"):
        context_parallel(loss, cpp=4)
    with pytest.raises(ContextParallelOptionError, match="unknown schedule='spiral'"):
        context_parallel(loss, schedule="spiral")
    with pytest.raises(PlanError, match="Ulysses splits the 4 query heads over cp=8"):
        context_parallel(loss, cp=8, schedule="ulysses")(params, tokens)


def test_gradients_inside_are_refused(llama_case):
    loss, params, tokens, _ = llama_case
    train_step = context_parallel(lambda p, t: jax.grad(loss)(p, t), cp=4)
    with pytest.raises(ContextParallelError, match="apply jax.grad"):
        train_step(params, tokens)


@pytest.mark.slow
def test_seq_axes_override():
    """An input the dataflow cannot reach (a position table) is named explicitly."""
    def fn(x, table):
        q = x + table
        return jax.nn.dot_product_attention(q, x, x, is_causal=True).sum()

    x = jax.random.normal(jax.random.key(0), (1, 16, 2, 4))
    table = jax.random.normal(jax.random.key(1), (1, 16, 2, 4))
    f = context_parallel(fn, cp=4, seq_axes=(1, 1))
    np.testing.assert_allclose(f(x, table), fn(x, table), rtol=RTOL)
    with pytest.raises(ContextParallelOptionError, match="one entry per positional argument"):
        context_parallel(fn, cp=4, seq_axes=(1,))(x, table)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ring", "ulysses"])
def test_one_layer_moves_only_schedule_collectives(schedule):
    """Compiled (GSPMD-partitioned) HLO of one layer's value_and_grad: no all-gather of a
    sequence-sharded activation; only the schedule's collectives and gradient reductions."""
    cfg = llama.Config(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, mlp_dim=64)
    params = jax.eval_shape(lambda k: llama.init_params(k, cfg), jax.random.key(0))
    layer = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], p.dtype),
                                   params["layers"])
    x = jax.ShapeDtypeStruct((2, 64, 32), jnp.float32)

    def one_layer(layer, x):
        return jnp.sum(llama.block(x, layer, cfg) ** 2)

    f = context_parallel(one_layer, cp=4, schedule=schedule, load_balance="none")
    hlo = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(layer, x).compile().as_text()
    kind = re.compile(r" (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
                      r"(?:-start)?\(")
    ops = [(re.search(r"= \(?(\w+)\[([\d,]*)\]", line).groups() + (m.group(1),))
           for line in hlo.splitlines() if (m := kind.search(line))]
    # Ulysses gathers the int32 positions of the whole sequence: its own, small collective.
    gathered = [(t, s) for t, s, op in ops if op == "all-gather" and t != "s32"]
    assert gathered == [], f"activations gathered: {gathered}"
    kinds = {op for t, _, op in ops if t != "s32"}
    assert ("collective-permute" if schedule == "ring" else "all-to-all") in kinds
    assert kinds <= {"collective-permute", "all-to-all", "all-reduce"}


def test_elementwise_results_take_their_operands_sharding():
    """lower-context-parallel constrains a sequence-sharded value where a reshape, product,
    gather or call makes it, not after every elementwise op of a chain (the partitioner
    gives such a result its operand's sharding; the constraints cost tracing time only):
    no constraint follows an elementwise op on an operand of the same shape, every
    projection of the hidden states is constrained, and the numbers are one device's."""
    cfg = llama.Config(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, mlp_dim=64)
    layer = jax.tree_util.tree_map(lambda p: p[0], llama.init_params(jax.random.key(3),
                                                                      cfg)["layers"])
    x = jax.random.normal(jax.random.key(4), (2, 64, 32))

    def one_layer(layer, x):
        return jnp.sum(llama.block(x, layer, cfg) ** 2)

    f = context_parallel(one_layer, cp=4, schedule="ring")
    jaxpr = f.module(layer, x).jaxpr.jaxpr
    made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    constrained = [made.get(eqn.invars[0]) for eqn in jaxpr.eqns
                   if eqn.primitive.name == "sharding_constraint"]
    elementwise = names_of(Family.ELEMENTWISE)
    inherited = [e.primitive.name for e in constrained
                 if e is not None and e.primitive.name in elementwise
                 and any(a in made and a.aval.shape == e.outvars[0].aval.shape
                         for a in e.invars)]
    assert inherited == []
    projections = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"
                   and e.outvars[0].aval.shape[:2] == (2, 64)]
    assert len(projections) >= 4 and all(e in constrained for e in projections)
    ref = jax.value_and_grad(one_layer, argnums=(0, 1))(layer, x)
    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(layer, x)
    np.testing.assert_allclose(got[0], ref[0], rtol=RTOL)
    assert_tree_close(got[1], ref[1])


@pytest.mark.slow
def test_flax_linen_block():
    """A flax MultiHeadDotProductAttention with make_causal_mask, unchanged user code."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            h = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)(x, x, mask=mask)
            return nn.LayerNorm()(x + h)

    model = Block()
    x = jax.random.normal(jax.random.key(0), (2, 32, 32))
    params = model.init(jax.random.key(1), x)

    def loss(p, x):
        return jnp.mean(jnp.sin(model.apply(p, x)) * x)

    ref_v, ref_g = jax.value_and_grad(loss)(params, x)
    f = context_parallel(loss, cp=4, schedule="ring", load_balance="zigzag")
    value, grads = jax.value_and_grad(f)(params, x)
    np.testing.assert_allclose(value, ref_v, rtol=RTOL)
    # The key bias gradient is zero analytically (softmax ignores a per-row shift), so
    # compare every leaf against the largest gradient instead of its own magnitude.
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(ref_g))
    for a, e in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_g)):
        np.testing.assert_allclose(a, e, atol=RTOL * scale, rtol=0)
    assert "rewritten [causal]" in f.explain(params, x, verbose=True)


@pytest.mark.slow
def test_bf16_model_is_at_least_as_close_to_float32(llama_case):
    """bf16 parameters: attention accumulates in float32, so the transformed gradients are
    within 2e-2 of the float32 run on the same (rounded) parameters, no worse than the bf16
    single-device run."""
    loss, params, tokens, _ = llama_case
    half = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    ref_loss, ref_grads = jax.value_and_grad(loss)(
        jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), half), tokens)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(ref_grads))

    def error(grads):
        return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - e))) for a, e in
                   zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads))
                   ) / scale

    value, grads = jax.value_and_grad(context_parallel(loss, cp=4))(half, tokens)
    _, single = jax.value_and_grad(loss)(half, tokens)
    np.testing.assert_allclose(float(value), float(ref_loss), rtol=2e-2)
    assert error(grads) <= 2e-2
    assert error(grads) <= error(single)


@pytest.mark.slow
def test_bare_decorator_and_permuted_outputs():
    """``@context_parallel`` without arguments uses every device; ``keep_permuted`` returns
    sequence outputs in the layout's order (zigzag over 8 devices here)."""
    from cptransform.op.layouts import SequenceLayout

    def hidden(x):
        return jax.nn.dot_product_attention(x, x, x, is_causal=True)

    x = jax.random.normal(jax.random.key(7), (1, 32, 2, 4))
    bare = context_parallel(hidden)
    np.testing.assert_allclose(bare(x), hidden(x), rtol=RTOL, atol=1e-6)
    assert "cp=8" in bare.explain(x)
    kept = context_parallel(hidden, keep_permuted=True, load_balance="zigzag")
    expected = SequenceLayout("zigzag", 32, 8).permute(hidden(x), axis=1)
    np.testing.assert_allclose(kept(x), expected, rtol=RTOL, atol=1e-6)


@pytest.mark.slow
def test_remat_layers_stay_rematerialized(llama_case):
    """Layers under jax.checkpoint inside the scan keep their remat through zigzag
    reordering and lowering, and the numbers still match."""
    from cptransform.ir.module import iter_eqns

    loss, params, tokens, _ = llama_case
    cfg = llama.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp_dim=64)

    def remat_loss(p, t):
        x = p["embed"][t]
        step = jax.checkpoint(lambda h, layer: (llama.block(h, layer, cfg), None))
        x, _ = jax.lax.scan(step, x, p["layers"])
        logits = (llama.rms_norm(x, p["final_norm"], cfg.norm_eps) @ p["unembed"])[:, :-1]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, 1:, None], axis=-1)
        return -jnp.mean(picked)

    ref_v, ref_g = jax.value_and_grad(remat_loss)(params, tokens)
    f = context_parallel(remat_loss, cp=4, load_balance="zigzag")
    value, grads = jax.value_and_grad(f)(params, tokens)
    np.testing.assert_allclose(value, ref_v, rtol=RTOL)
    assert_tree_close(grads, ref_g)
    names = {e.primitive.name for e in iter_eqns(f.module(params, tokens).jaxpr)}
    assert names & {"remat2", "checkpoint"}


def position_table_model(p, tokens):
    """A learned position table longer than the sequence, sliced, plus a position table
    computed with numpy at trace time (a constant that carries the sequence axis)."""
    s = tokens.shape[1]
    x = p["emb"][tokens] + p["pos"][:s][None]
    x = x + jnp.asarray(np.sin(np.arange(s)[:, None] * np.linspace(0.1, 1.0, 16)), jnp.float32)
    q = x.reshape(x.shape[0], s, 2, 8)
    return jnp.mean(jnp.tanh(jax.nn.dot_product_attention(q, q, q, is_causal=True)) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("load_balance", ["zigzag", "striped"])
def test_position_tables_follow_the_reordering(load_balance):
    keys = jax.random.split(jax.random.key(9), 3)
    p = {"emb": jax.random.normal(keys[0], (20, 16)), "pos": jax.random.normal(keys[1], (48, 16))}
    tokens = jax.random.randint(keys[2], (2, 32), 0, 20)
    ref_v, ref_g = jax.value_and_grad(position_table_model)(p, tokens)
    f = context_parallel(position_table_model, cp=4, load_balance=load_balance)
    value, grads = jax.value_and_grad(f)(p, tokens)
    np.testing.assert_allclose(value, ref_v, rtol=RTOL)
    assert_tree_close(grads, ref_g)
    assert "args[0]['pos'] dim [0], args[1] dim [1]" in f.explain(p, tokens)


@pytest.mark.slow
def test_padded_batch_needs_no_square_mask():
    """A ``tokens != pad`` mask becomes a key-padding term (a ``[B, S]`` vector travelling
    with the keys): nothing S×S reaches the schedule."""
    keys = jax.random.split(jax.random.key(11), 2)
    x = jax.random.normal(keys[0], (2, 32, 2, 8))
    tokens = jax.random.randint(keys[1], (2, 32), 0, 4)  # 0 is padding

    def padded(x, tokens):
        keep = (tokens != 0)[:, None, None, :]
        return jnp.sum(jax.nn.dot_product_attention(x, x, x, mask=keep, is_causal=True) ** 2)

    f = context_parallel(padded, cp=4, load_balance="zigzag")
    ref_v, ref_g = jax.value_and_grad(padded)(x, tokens)
    value, grad = jax.value_and_grad(f)(x, tokens)
    np.testing.assert_allclose(value, ref_v, rtol=RTOL)
    assert_tree_close(grad, ref_g)
    text = f.explain(x, tokens, verbose=True)
    assert "rewritten [causal key_padding] causal key_padding empty=uniform" in text
    assert "mask: causal key_padding empty=uniform;" in text


def _scanned_remat_vmapped(params, x):
    """Layers under ``lax.scan(jax.checkpoint(block))`` inside ``jax.vmap`` over the batch:
    the scan body is visited more often than there are attentions in the program."""
    seq, dim = x.shape[1:]
    heads = 4

    def per_example(h0):
        def block(h, w):
            q, k, v = ((h @ w[name]).reshape(seq, heads, dim // heads)[None]
                       for name in ("q", "k", "v"))
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True)[0]
            return h + o.reshape(seq, dim) @ w["o"], None

        h, _ = jax.lax.scan(jax.checkpoint(block), h0, params)
        return h

    return jnp.mean(jax.vmap(per_example)(x) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance", [
    ("ring", "zigzag"), ("ulysses", "none"), ("allgather", "zigzag"), ("hybrid", "zigzag"),
])
def test_scan_remat_vmap_each_schedule(schedule, load_balance):
    """Regression: the plan was looked up by visit order and crashed (IndexError) here."""
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    layers, dim = 2, 16
    params = {n: jax.random.normal(key, (layers, dim, dim)) / 4
              for n, key in zip("qkvo", keys[:4])}
    x = jax.random.normal(keys[4], (2, 32, dim))
    if schedule == "hybrid":
        f = context_parallel(_scanned_remat_vmapped, load_balance=load_balance,
                             mesh=make_mesh((2, 2), ("uly", "ring")), axis=("uly", "ring"))
    else:
        f = context_parallel(_scanned_remat_vmapped, cp=4, schedule=schedule,
                             load_balance=load_balance)
    value, grads = jax.jit(jax.value_and_grad(f))(params, x)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(_scanned_remat_vmapped))(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL)
    assert_tree_close(grads, ref_grads)
    assert f"schedule: {schedule}" in f.explain(params, x)


def _temp_bytes(fn, *args):
    """Temporary bytes per device of ``jit(value_and_grad(fn))`` compiled for ``args``."""
    return jax.jit(jax.value_and_grad(fn)).lower(*args).compile().memory_analysis() \
        .temp_size_in_bytes


@pytest.mark.parametrize("schedule", ["ring", pytest.param("ulysses", marks=pytest.mark.slow),
                                      pytest.param("allgather", marks=pytest.mark.slow)])
def test_a_layer_scan_holds_what_the_unrolled_layers_hold(schedule):
    """Under ``grad`` of a ``lax.scan`` over layers, JAX hoists what the body derives from
    loop-invariant inputs alone and saves it for the backward; the kernels derive every
    chunk pair's mask tiles from the positions, which are such inputs. The schedules tie
    their operands together (``schedule.tied``), so the scanned model holds no more temp
    memory than the same layers unrolled, up to the scan's own buffers (a few MiB whatever
    the depth); before, 11x more at 4K tokens and 46x at 16K (1.6 GiB per device)."""
    cfg = llama.Config(vocab=64, dim=64, layers=4, heads=8, kv_heads=8 if schedule == "ulysses"
                       else 2, mlp_dim=64)
    params = jax.eval_shape(lambda k: llama.init_params(k, cfg), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, 4096), jnp.int32)

    def unrolled(p, t):
        x = p["embed"][t]
        for i in range(cfg.layers):
            x = llama.block(x, jax.tree_util.tree_map(lambda w: w[i], p["layers"]), cfg)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    def scanned(p, t):
        def layer(x, w):
            return llama.block(x, w, cfg), None
        x, _ = jax.lax.scan(layer, p["embed"][t], p["layers"])
        return jnp.mean(x.astype(jnp.float32) ** 2)

    scan_bytes, loop_bytes = (
        _temp_bytes(context_parallel(fn, cp=8, schedule=schedule), params, tokens)
        for fn in (scanned, unrolled))
    assert scan_bytes <= 1.25 * loop_bytes, (scan_bytes, loop_bytes)
