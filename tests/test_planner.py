"""The planner: a cost model predicting time (hardware table, executed FLOPs after block
skipping, memory, overlap), ``auto`` per attention under a memory limit, and the hybrid
built from ``cp`` alone. Expectations are the formulas', never timings."""
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh

from cptransform import ContextParallelOptionError, attention, context_parallel
from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import executed_entries
from cptransform.analysis.hardware import HARDWARE, hardware_for_device
from cptransform.analysis.local_memory import query_state_bytes, shard_bytes
from cptransform.lowering.block import Block
from cptransform.lowering.kernels.chunked import executed_fraction
from cptransform.lowering.schedule import Schedule, schedules
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.op.layouts import LAYOUTS, SequenceLayout
from cptransform.passes.plan_context_parallel import PlanError

MiB = 2 ** 20
RTOL = 1e-5
H100 = HARDWARE["h100"]
WORKED = dict(heads=32, head_dim=128, cp=8, dtype_bytes=2, positions=False, layout="zigzag")


def predict(name, shape, hardware=H100):
    return schedules()[name].predict(shape, hardware)


# -- the cost model --------------------------------------------------------------------------

@pytest.mark.parametrize("kv_heads", [32, 8])
def test_overlap_condition_is_f_over_b_scaled_by_kv_heads(kv_heads):
    """Full mask (every tile computed): the ring's block must reach ``F/B · h_kv/h`` tokens
    for its transfers to hide behind compute (``c ≥ F/B`` of docs/architecture.md, bf16)."""
    shape = AttentionShape(seq_len=128 * 1024, kv_heads=kv_heads, **WORKED)
    ring = predict("ring", shape)
    f_over_b = H100.flops_per_s(2) / H100.link(8).bytes_per_s
    assert ring.overlap_tokens == pytest.approx(f_over_b * kv_heads / 32, rel=1e-12)
    assert ring.block_tokens == 16 * 1024


@pytest.mark.parametrize("kv_heads,ulysses_mib", [(32, 448), (8, 280)])
def test_design_worked_numbers_priced(kv_heads, ulysses_mib):
    """s = 128K, h = 4096, cp = 8, bf16, causal, on H100 (NVLink): Ulysses waits for its
    448 / 280 MiB of all-to-alls; the ring's 16K-token blocks hide its transfers, so only
    latency is exposed and ``auto`` picks the ring."""
    shape = AttentionShape(seq_len=128 * 1024, kv_heads=kv_heads, band=(None, 0), **WORKED)
    ulysses, ring = predict("ulysses", shape), predict("ring", shape)
    work = schedules()["ulysses"].work(shape)
    nvlink = H100.link(8)
    assert ulysses.forward_s == pytest.approx(
        work.forward_flops / H100.flops_per_s(2) + ulysses_mib * MiB / nvlink.bytes_per_s
        + 4 * nvlink.latency_s, rel=1e-12)
    assert ring.block_tokens >= ring.overlap_tokens
    ring_work = schedules()["ring"].work(shape)
    assert ring.forward_s == pytest.approx(
        ring_work.forward_flops / H100.flops_per_s(2) + 7 * nvlink.latency_s, rel=1e-12)
    assert ring.time_s < ulysses.time_s


def test_short_blocks_cannot_hide_the_ring():
    """s = 8K, MHA: a 1K-token block is under F/B ≈ 1.1K, so the ring exposes transfers and
    Ulysses, moving a quarter of the bytes, is predicted faster; with 8 KV heads the
    threshold drops 4x and the ring wins again."""
    mha = AttentionShape(seq_len=8 * 1024, kv_heads=32, **WORKED)
    assert predict("ring", mha).overlap_tokens > 1024
    assert predict("ulysses", mha).time_s < predict("ring", mha).time_s
    gqa = replace(mha, kv_heads=8)
    assert predict("ring", gqa).overlap_tokens < 1024
    assert predict("ring", gqa).time_s < predict("ulysses", gqa).time_s


def test_links_follow_the_device_span():
    """Over 16 H100s the ring crosses InfiniBand; a hybrid with Ulysses groups of 8 keeps
    its all-to-alls on NVLink and sends only the ring's rotations over InfiniBand."""
    assert H100.link(8).name == "nvlink" and H100.link(16).name == "infiniband"
    shape = AttentionShape(seq_len=32 * 1024, heads=64, kv_heads=8, head_dim=128, cp=16,
                           layout="zigzag", band=(None, 0))
    hybrid = predict("hybrid", replace(shape, ulysses=8))
    ring = predict("ring", shape)
    assert hybrid.time_s < ring.time_s


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", [MaskSpec(causal=True), MaskSpec(window=(5, 0)),
                                  MaskSpec(causal=True, window=(9, None)),
                                  MaskSpec(causal=True, chunk=12), MaskSpec(chunk=8)])
def test_executed_entries_match_the_kernel_classification(layout, mask):
    """The analysis counts exactly the score entries the chunked kernel computes."""
    seq, cp, chunk = 64, 4, 4
    positions = SequenceLayout(layout, seq, cp).all_positions()
    bthd = Layout.parse("BTHD")
    spec = AttentionSpec(q=bthd, k=bthd, v=bthd, scale=1.0, mask=mask)
    for q_pos in positions:
        for k_pos in positions:
            block = Block(q=jnp.zeros((1, len(q_pos), 1, 1)), k=jnp.zeros((1, len(k_pos), 1, 1)),
                          v=jnp.zeros((1, len(k_pos), 1, 1)), q_pos=jnp.asarray(q_pos)[None],
                          kv_pos=jnp.asarray(k_pos)[None])
            kernel = float(executed_fraction(block, spec, chunk)) * len(q_pos) * len(k_pos)
            assert executed_entries(q_pos, k_pos, mask.terms(), chunk) == round(kernel)


def test_zigzag_balances_and_skips_half():
    """Causal over 8 devices: contiguous leaves the last ring device ``(2·cp-1)/cp`` of the
    mean; zigzag balances it; every schedule executes about half the scores."""
    shape = AttentionShape(seq_len=64 * 1024, heads=8, kv_heads=8, head_dim=64, cp=8,
                           band=(None, 0))
    contiguous = schedules()["ring"].work(shape)
    zigzag = schedules()["ring"].work(replace(shape, layout="zigzag"))
    assert contiguous.balance == pytest.approx(15 / 8, rel=0.02)
    assert zigzag.balance == pytest.approx(1.0, abs=1e-3)
    full = 64 * 1024 * 64 * 1024 * 8 // 8 * 2 * 128
    assert zigzag.forward_flops == pytest.approx(full / 2, rel=0.02)


def test_hardware_rows():
    assert hardware_for_device("cpu", "cpu") == "cpu-sim"
    assert hardware_for_device("gpu", "NVIDIA H100 80GB HBM3") == "h100"
    assert hardware_for_device("tpu", "TPU v5 lite") == "tpu-v5e"
    assert hardware_for_device("gpu", "Some Future GPU") is None
    assert {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "a100", "h100", "h200",
            "cpu-sim"} <= set(HARDWARE)


# -- auto through context_parallel ------------------------------------------------------------

def _operands(seq=64, heads=8, kv_heads=8, d=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (1, seq, heads, d)),
            jax.random.normal(keys[1], (1, seq, kv_heads, d)),
            jax.random.normal(keys[2], (1, seq, kv_heads, d)))


def one_attention(q, k, v):
    return jnp.sum(jnp.sin(attention(q, k, v, causal=True)))


def assert_matches_one_device(fn, cp_fn, *args):
    value, grads = jax.value_and_grad(cp_fn, argnums=tuple(range(len(args))))(*args)
    ref_value, ref_grads = jax.value_and_grad(fn, argnums=tuple(range(len(args))))(*args)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(r))))


def plans_of(fn, *args, **options):
    return context_parallel(fn, cp=8, **options).module(*args).facts.plan


def test_auto_picks_the_least_predicted_time_and_names_the_runner_up():
    args = _operands()
    f = context_parallel(one_attention, cp=8)
    (plan,) = f.module(*args).facts.plan
    times = {p.schedule: p.time_s for p in plan.predictions}
    assert plan.schedule == min(times, key=times.get)
    assert plan.runner_up == sorted(times, key=times.get)[1]
    text = f.explain(*args, verbose=True)
    assert f"schedule: {plan.schedule} — least predicted time on cpu-sim" in text
    assert f"runner-up {plan.runner_up}" in text
    assert all(f"      {name}: " in text for name in times)


def test_memory_limit_excludes_the_fastest():
    """GQA (2 KV heads): the fastest schedule needs more memory than another; a limit just
    under it moves the choice to the fastest that fits."""
    args = _operands(kv_heads=2)
    (free,) = plans_of(one_attention, *args)
    fastest = free.predictions[0]
    limit = fastest.memory_bytes - 1
    (limited,) = plans_of(one_attention, *args, memory_limit=limit)
    fitting = [p for p in free.predictions if p.memory_bytes <= limit]
    assert fitting, "the test needs a schedule under the limit"
    assert limited.schedule == fitting[0].schedule != fastest.schedule
    assert f"{fastest.schedule}: needs" in limited.reason
    assert "over the memory limit" in limited.reason
    with pytest.raises(PlanError, match="over the memory limit.*raise memory_limit"):
        plans_of(one_attention, *args, memory_limit=1)


def test_infeasible_is_never_chosen():
    """6 query heads cannot split over 8 devices: Ulysses is excluded with its reason."""
    args = _operands(heads=6, kv_heads=6)
    (plan,) = plans_of(one_attention, *args)
    assert plan.schedule != "ulysses" and "ulysses" not in {p.schedule for p in plan.predictions}
    assert "excluded: ulysses: Ulysses splits the 6 query heads" in plan.reason


def two_attentions(q1, k1, v1, q2, k2, v2):
    o1 = attention(q1, k1, v1, causal=True)
    o2 = attention(q2, k2, v2, window=(8, 0))
    return jnp.sum(jnp.sin(o1)) + jnp.sum(jnp.cos(o2))


@pytest.mark.slow
def test_per_layer_choices_differ_and_match_one_device():
    """8 heads (Ulysses feasible and predicted fastest) next to 6 heads with a window (it
    is not): one program, two schedules, the single-device numbers."""
    args = _operands(seed=1) + _operands(heads=6, kv_heads=2, seed=2)
    plans = plans_of(two_attentions, *args)
    for plan in plans:
        assert plan.schedule == plan.predictions[0].schedule
    assert plans[0].schedule != plans[1].schedule
    assert_matches_one_device(two_attentions, context_parallel(two_attentions, cp=8), *args)


@pytest.mark.slow
def test_hybrid_from_cp_alone_builds_its_mesh_and_matches_one_device():
    """4 KV heads over cp=8: Ulysses degree 2 or 4, whichever the cost model predicts
    faster; the mesh is built with Ulysses groups on consecutive devices."""
    args = _operands(kv_heads=4)
    shape = AttentionShape(seq_len=64, heads=8, kv_heads=4, head_dim=16, cp=8, dtype_bytes=4,
                           band=(None, 0), layout="zigzag")
    hybrid = schedules()["hybrid"]
    best = min((2, 4), key=lambda u: hybrid.predict(replace(shape, ulysses=u),
                                                     HARDWARE["cpu-sim"]).time_s)
    f = context_parallel(one_attention, cp=8, schedule="hybrid")
    facts = f.module(*args).facts
    assert dict(facts.mesh.shape) == {"uly": best, "ring": 8 // best}
    assert facts.cp_axes == ("uly", "ring") and facts.plan[0].schedule == "hybrid"
    assert [d.id for d in facts.mesh.devices[:, 0]] == list(range(best))
    assert f"hybrid Ulysses degree {best} (ring {8 // best})" in f.explain(*args)
    assert_matches_one_device(one_attention, f, *args)


def test_hybrid_from_cp_needs_a_degree_dividing_the_kv_heads():
    args = _operands(kv_heads=1)
    with pytest.raises(PlanError, match="no Ulysses degree 1 < U < 8 divides both cp and the "
                                        "KV heads"):
        context_parallel(one_attention, cp=8, schedule="hybrid").module(*args)


@pytest.mark.parametrize("options,message", [
    (dict(hardware="h900"), r"unknown hardware='h900' \(did you mean 'h[12]00'\?\); use one of tpu-v4"),
    (dict(memory_limit="120%"), "memory_limit='120%': give bytes per device"),
    (dict(memory_limit=-1), "memory_limit=-1"),
    (dict(memory_limit="lots"), "memory_limit='lots'"),
    (dict(memory_limit=True), "memory_limit=True"),
])
def test_option_errors(options, message):
    with pytest.raises(ContextParallelOptionError, match=message):
        context_parallel(one_attention, cp=8, **options)


def test_hybrid_with_a_one_axis_mesh_is_refused():
    with pytest.raises(ContextParallelOptionError, match="over mesh= needs two mesh axes"):
        context_parallel(one_attention, mesh=make_mesh((8,), ("cp",)), schedule="hybrid")


def test_explicit_hardware_and_percent_limit():
    """``hardware=`` prices on that row; ``"50%"`` is half its memory."""
    args = _operands()
    (plan,) = plans_of(one_attention, *args, hardware="h100", memory_limit="50%")
    assert "on h100" in plan.reason
    assert all(p.memory_bytes <= H100.memory_bytes // 2 for p in plan.predictions[:1])


@pytest.mark.slow
def test_a_layout_that_cannot_cut_the_length_is_priced_padded(rng):
    """Zigzag over 72 tokens at cp=8 is planned on 80 (padded inside the attention) and
    still matches one device."""
    q, k, v = (jnp.asarray(rng.normal(size=(1, 72, 8, 16)), jnp.float32) for _ in range(3))
    cp_fn = context_parallel(one_attention, cp=8, load_balance="zigzag")
    text = cp_fn.explain(q, k, v)
    assert "queries 72 -> 80 (+8)" in text and "zigzag inside the attentions" in text
    assert_matches_one_device(one_attention, cp_fn, q, k, v)


def test_memory_is_read_off_the_statement():
    """A record priced from its statement alone: all-gather's memory is its shards, the K
    and V its all-gathers deliver (the whole sequence), the float32 query state of its
    local queries, float32 dK/dV of every key and one score tile; the ring's holds two
    blocks (the one computed on and the one arriving) and two travelling accumulators."""
    allgather, ring = schedules()["allgather"], schedules()["ring"]
    bare = Schedule("bare", mesh_axes=1, run=allgather.run, statement=allgather.statement,
                    feasible=allgather.feasible)
    shape = AttentionShape(seq_len=4096, heads=8, kv_heads=2, head_dim=64, cp=8,
                           band=(None, 0), layout="zigzag")
    kv = 4096 * 2 * (64 + 64) * 2  # K and V of every key: one batch row, 2 KV heads, bf16
    tile = 2 * 8 * 128 * 128 * 4  # float32 scores and probabilities of one 128 x 128 tile
    assert bare.predict(shape, H100) == replace(allgather.predict(shape, H100), schedule="bare")
    assert bare.peak_memory(shape) == (shard_bytes(shape) + kv + query_state_bytes(shape, 512, 8)
                                       + 2 * kv + tile)
    block = kv // 8
    assert ring.peak_memory(shape) == (shard_bytes(shape) + 2 * block
                                       + query_state_bytes(shape, 512, 8) + 2 * 2 * block
                                       + 2 * 8 * 128 * 128 * 4)


def test_each_kernel_call_costs_the_rows_call_s():
    """The ring makes cp kernel calls per pass, Ulysses one: a row with a per-call cost
    adds it to each pass's compute that many times, forward and backward."""
    shape = AttentionShape(seq_len=64, heads=8, kv_heads=8, head_dim=16, cp=8,
                           band=(None, 0), layout="zigzag")
    free = replace(HARDWARE["cpu-sim"], call_s=0.0)
    costly = replace(free, call_s=1e-3)
    for name, calls in (("ring", 8), ("ulysses", 1), ("allgather", 1)):
        assert schedules()[name].work(shape).calls == calls
        extra = predict(name, shape, costly).compute_s - predict(name, shape, free).compute_s
        assert extra == pytest.approx(2 * calls * 1e-3, rel=1e-9)


def test_steps_pace_the_compute():
    """A ring step lasts until its busiest device is done. Dedicated devices: the causal
    contiguous ring's busiest device is the last one at every step, so its steps cost the
    slowest device's work (the balance). Eight devices on two cores (a device alone runs
    4x its share): only the last step, where one device computes a full block, leaves a
    core idle and costs twice its mean; zigzag's equal steps cost the mean."""
    shape = AttentionShape(seq_len=8 * 1024, heads=8, kv_heads=8, head_dim=64, cp=8,
                           band=(None, 0))
    contiguous = schedules()["ring"].work(shape)
    zigzag = schedules()["ring"].work(replace(shape, layout="zigzag"))
    assert contiguous.paced(1.0) == pytest.approx(contiguous.balance, rel=1e-12)
    full_block = (8 * 1024 // 8) ** 2 * 8
    mean = sum(m for m, _ in contiguous.steps)
    assert contiguous.steps[-1] == (full_block / 8, full_block)
    assert contiguous.paced(4.0) == pytest.approx(1 + full_block / 8 / mean, rel=1e-12)
    assert zigzag.paced(4.0) == 1.0
    assert HARDWARE["cpu-sim"].alone_speedup(8) == 4.0 and H100.alone_speedup(8) == 1.0


def test_score_tiles_cost_the_rows_tile_s():
    """The chunked kernel's tile holds float32 scores and probabilities of one 128 x 128
    chunk pair over the call's heads: the ring's 8 heads 1 MiB, Ulysses' 8/cp one head
    1/8 MiB; a row with ``tile_s`` adds that many MiB times ``tile_s`` per FLOP."""
    shape = AttentionShape(seq_len=8 * 1024, heads=8, kv_heads=8, head_dim=64, cp=8,
                           band=(None, 0), layout="zigzag")
    free = replace(HARDWARE["cpu-sim"], tile_s=0.0)
    costly = replace(free, tile_s=1e-11)
    for name, mib in (("ring", 1.0), ("ulysses", 1 / 8), ("allgather", 1.0)):
        work = schedules()[name].work(shape)
        assert work.tile_bytes == mib * MiB
        extra = predict(name, shape, costly).compute_s - predict(name, shape, free).compute_s
        flops = (work.forward_flops + work.backward_flops) / work.balance
        assert extra == pytest.approx(flops * mib * 1e-11, rel=1e-9)
