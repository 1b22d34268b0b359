"""match-attention on flax attention: linen functions and modules, nnx.MultiHeadAttention."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from test_match_support import check, randn, specs

B, T, H, D = 2, 8, 2, 8


@pytest.mark.slow
def test_linen_function_with_combined_masks(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    valid = jnp.asarray(rng.random((B, T)) > 0.2)

    def fn(q, k, v, valid):
        mask = nn.combine_masks(nn.make_causal_mask(jnp.ones((B, T))),
                                nn.make_attention_mask(valid, valid))
        return nn.dot_product_attention(q, k, v, mask=mask)

    (spec,) = specs(check(fn, q, k, v, valid))
    assert spec.mask.causal and spec.mask.q_padding and spec.mask.kv_padding
    assert spec.mask.empty_rows == "uniform"


def test_linen_causal_only(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    fn = lambda q, k, v: nn.dot_product_attention(  # noqa: E731
        q, k, v, mask=nn.make_causal_mask(jnp.ones((B, T))))
    (spec,) = specs(check(fn, q, k, v, analytic=True))
    assert spec.mask.causal


@pytest.mark.slow
@pytest.mark.parametrize("layers", [1, 2])
def test_linen_module(rng, layers):
    x = randn(rng, B, T, 16)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(layers):
                x = x + nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=16)(
                    x, mask=nn.make_causal_mask(x[..., 0]))
            return x

    model = Model()
    params = model.init(jax.random.key(0), x)
    specs_found = specs(check(model.apply, params, x, count=layers, analytic=True))
    assert all(s.mask.causal for s in specs_found)


@pytest.mark.slow
def test_nnx_multi_head_attention(rng):
    x = randn(rng, B, T, 16)
    mha = nnx.MultiHeadAttention(num_heads=H, in_features=16, qkv_features=16, decode=False,
                                 rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(mha)

    def fn(state, x):
        return nnx.merge(graphdef, state)(x, mask=nn.make_causal_mask(x[..., 0]))

    (spec,) = specs(check(fn, state, x, analytic=True))
    assert spec.mask.causal
