"""The StableHLO collective counter on small hand-written shard_map programs."""
import jax
import jax.numpy as jnp
import pytest
from conftest import make_mesh
from jax import lax
from jax.sharding import PartitionSpec as P

from cptransform.lowering.collectives import CollectiveParseError, count_collectives, \
    lower_and_count

X = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.bfloat16)  # 2048 B per device on a 2x4 mesh
SHARD_BYTES = 2 * 2 * 4 * 8 * 2


def on_mesh(body, *, out_specs=P()):
    mesh = make_mesh((2, 4), ("u", "r"))
    return jax.shard_map(body, mesh=mesh, in_specs=P(None, ("r", "u")), out_specs=out_specs,
                         check_vma=False)


def total(x):
    return jnp.sum(x.astype(jnp.float32))


def test_each_kind_with_its_group_and_bytes():
    def body(x):
        a = lax.all_to_all(x, "u", 2, 1, tiled=True)
        g = lax.all_gather(x, "r", axis=1, tiled=True)
        p = lax.ppermute(x, "r", [(i, (i + 1) % 4) for i in range(4)])
        rs = lax.psum_scatter(x.astype(jnp.float32), "r", scatter_dimension=2, tiled=True)
        ar = lax.psum(total(x), "u")
        return total(a) + total(g) + total(p) + total(rs) + ar

    report = lower_and_count(on_mesh(body), X)
    by_kind = {c.kind: c for c in report.collectives}
    assert report.counts() == dict.fromkeys(by_kind, 1)
    assert by_kind["all_to_all"].dtype == "bf16"
    assert by_kind["all_to_all"].bytes_per_device == SHARD_BYTES // 2
    assert by_kind["all_to_all"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert by_kind["all_gather"].bytes_per_device == SHARD_BYTES * 3
    assert by_kind["all_gather"].results[0].shape == (2, 8, 4, 8)
    assert by_kind["collective_permute"].bytes_per_device == SHARD_BYTES
    assert (0, 1) in by_kind["collective_permute"].groups
    assert by_kind["reduce_scatter"].dtype == "f32"
    assert by_kind["reduce_scatter"].bytes_per_device == 2 * SHARD_BYTES * 3 // 4
    assert by_kind["all_reduce"].bytes_per_device == 4  # f32 scalar, 2·4·(2-1)/2
    assert report.per_device_bytes == sum(c.bytes_per_device for c in report.collectives)


@pytest.mark.parametrize("loop", ["fori", "scan"])
def test_loops_multiply_by_their_trip_count(loop):
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def body(x):
        step = lambda c: lax.ppermute(c, "r", ring)  # noqa: E731
        if loop == "fori":
            y = lax.fori_loop(2, 7, lambda i, c: step(c), x)
        else:
            y, _ = lax.scan(lambda c, _: (step(c), None), x, None, length=3)
        return total(y)

    report = lower_and_count(on_mesh(body), X)
    (permute,) = report.collectives
    assert permute.count == (5 if loop == "fori" else 3)
    assert report.per_device_bytes == permute.count * SHARD_BYTES


def test_nested_loops_and_calls():
    def body(x):
        def inner(c):
            return jax.jit(lambda y: lax.all_to_all(y, "u", 2, 1, tiled=True)
                           .reshape(y.shape))(c)

        def outer(i, c):
            return lax.fori_loop(0, 3, lambda j, d: inner(d), c)
        return total(lax.fori_loop(0, 2, outer, x))

    report = lower_and_count(on_mesh(body), X)
    assert report.counts() == {"all_to_all": 6}


def test_unknown_trip_count_is_an_error():
    def body(x):
        n = jnp.sum(x > 0).astype(jnp.int32)
        return total(lax.fori_loop(0, n, lambda i, c: lax.ppermute(c, "r", [(0, 1)]), x))

    with pytest.raises(CollectiveParseError, match="trip count"):
        lower_and_count(on_mesh(body), X)


def test_unknown_trip_count_without_collectives_is_read():
    """A data-dependent loop that runs no collective needs no trip count; the collectives
    around it are counted."""
    def body(x):
        n = jnp.sum(x > 0).astype(jnp.int32)
        y = lax.fori_loop(0, n, lambda i, c: c * 2.0, x)
        return total(lax.fori_loop(0, 3, lambda i, c: lax.ppermute(c, "r", [(0, 1)]), y))

    assert lower_and_count(on_mesh(body), X).counts() == {"collective_permute": 3}


def test_program_without_collectives():
    text = jax.jit(lambda x: x * 2).lower(X).as_text()
    assert count_collectives(text).per_device_bytes == 0
