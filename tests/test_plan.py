"""``explain()`` as a plan: identical attentions once, each at the nearest line of the
user's code (and the library's, for Flax modules), notes behind ``verbose=True``; the typed
``fn.plan(*args)`` and ``cptransform plan --json``, which round-trip through JSON."""
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import attention, context_parallel
from cptransform.api.cli import main
from cptransform.api.plan import Plan, index_ranges

LAYERS = 4


def stacked(ws, x):
    """``LAYERS`` identical causal attention layers, then a loss with its own softmax."""
    for w in ws:
        q = jnp.einsum("bsd,dhk->bshk", x, w)
        x = x + attention(q, q, q, causal=True).reshape(x.shape)
    return jnp.mean(jax.nn.log_softmax(x)[..., 0] + jax.nn.softmax(x)[..., 1])


def _stacked_args():
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(16, 2, 8)) * 0.1, jnp.float32) for _ in range(LAYERS)]
    return ws, jnp.asarray(rng.normal(size=(1, 32, 16)), jnp.float32)


@pytest.mark.slow
def test_identical_layers_are_listed_once_and_the_plan_round_trips():
    args = _stacked_args()
    f = context_parallel(stacked, cp=4, schedule="ring", load_balance="zigzag")
    text = f.explain(*args)
    assert f"attentions #0–{LAYERS - 1} ({LAYERS}×) at {__file__}:" in text
    assert text.count("schedule: ring") == 1 and len(text.splitlines()) <= 14
    assert "matcher: 0 attention(s) rewritten, 2 softmax(es) left alone" in text
    assert "refused" not in text
    verbose = f.explain(*args, verbose=True)
    assert "refused:" in verbose and "load balance per layout" in verbose

    plan = f.plan(*args)
    (group,) = plan.attentions
    assert group.indices == tuple(range(LAYERS)) and plan.attention_count == LAYERS
    assert (group.schedule, group.layout, group.kernel) == ("ring", "zigzag", "xla")
    assert group.source.startswith(f"{__file__}:") and group.library_source is None
    assert group.bytes_per_device["ring"] > 0 and group.shape.seq_len == 32
    assert plan.layout == "zigzag" and plan.reordered and plan.mesh == {"cp": 4}
    assert [p.name for p in plan.passes][-1] == "lower-context-parallel"
    assert len(plan.left_alone) == 2
    assert Plan.from_json(plan.to_json()) == plan


def test_different_attentions_are_separate_groups(tmp_path, capsys):
    model = tmp_path / "mixed.py"
    model.write_text("import jax.numpy as jnp\nfrom cptransform import attention\n\n"
                     "def f(q):\n    for i in range(4):\n"
                     "        q = attention(q, q, q, causal=i % 2 == 0)\n"
                     "    return jnp.sum(q)\n")
    assert main(["plan", f"{model}:f", "--args", "f32[1,16,2,8]", "--cp", "4",
                 "--schedule", "allgather", "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert [g.indices for g in plan.attentions] == [(0, 2), (1, 3)]
    assert [g.label for g in plan.attentions] == ["attentions #0, 2 (2×)",
                                                 "attentions #1, 3 (2×)"]
    assert [g.mask for g in plan.attentions] == ["causal", ""] or \
        plan.attentions[0].mask != plan.attentions[1].mask
    assert index_ranges((0, 1, 2, 3, 8, 10, 11)) == "0–3, 8, 10–11"


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(
                x, mask=nn.make_causal_mask(x[..., 0]))
        return x


@pytest.mark.slow
def test_flax_attention_points_at_the_users_line_and_the_library_frame():
    model, x = Block(), jnp.ones((1, 16, 16))
    params = model.init(jax.random.key(0), x)
    f = context_parallel(lambda p, x: jnp.sum(model.apply(p, x)), cp=4, schedule="ring")
    (group,) = f.plan(params, x).attentions
    assert group.indices == (0, 1)
    assert re.fullmatch(rf"{re.escape(__file__)}:\d+ \(Block.__call__\)", group.source)
    assert "flax" in group.library_source and "attention.py" in group.library_source
    assert f"    in library code at {group.library_source}" in f.explain(params, x)


def test_cli_plan_json_round_trips(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text("import jax.numpy as jnp\nfrom cptransform import attention\n\n"
                     "def f(q):\n    return jnp.sum(attention(q, q, q, causal=True))\n")
    assert main(["plan", f"{model}:f", "--args", "f32[1,32,2,8]", "--cp", "4",
                 "--schedule", "ring", "--json"]) == 0
    text = capsys.readouterr().out
    plan = Plan.from_json(text)
    assert json.loads(plan.to_json()) == json.loads(text)
    (group,) = plan.attentions
    assert group.schedule == "ring" and group.source.startswith(f"{model}:5")
    assert [p.name for p in plan.passes][-1] == "reorder-sequence"


FLAX_MODEL = """
import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(
                x, mask=nn.make_causal_mask(x[..., 0]))
        return x


def make():
    model, x = Block(), jnp.ones((1, 16, 16))
    params = model.init(jax.random.key(0), x)
    return (lambda p, x: jnp.sum(model.apply(p, x))), (params, x)
"""


@pytest.mark.slow
def test_cli_plan_groups_flax_layers_at_the_users_line(tmp_path, capsys):
    model = tmp_path / "flax_model.py"
    model.write_text(FLAX_MODEL)
    assert main(["plan", f"{model}:make", "--cp", "4", "--schedule", "ring", "--json"]) == 0
    (group,) = Plan.from_json(capsys.readouterr().out).attentions
    assert group.indices == (0, 1, 2)
    assert re.fullmatch(rf"{re.escape(str(model))}:11 \(Block.__call__\)", group.source)
    assert "flax" in group.library_source and "attention.py" in group.library_source
    assert main(["plan", f"{model}:make", "--cp", "4", "--schedule", "ring"]) == 0
    out = capsys.readouterr().out
    assert "attentions #0–2 (3×) at " in out and "    in library code at " in out
    assert out.count("attentions #0–2 (3×) (ring):") == 1
