"""Simulate 8 CPU devices before JAX is imported, and offer meshes built from
``jax.devices()`` so the same tests run unchanged on a TPU or GPU slice."""
import os

# Only on CPU: with JAX_PLATFORMS=tpu/cuda the tests use the real devices of the slice.
if os.environ.get("JAX_PLATFORMS", "cpu") in ("", "cpu"):
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8").strip()
    # LLVM's optimisation of the CPU code off: compiling is about 30% faster, and every
    # test compares programs compiled alike. XLA's HLO passes (the SPMD partitioner, where
    # XLA's bugs met us) run as ever. CPTRANSFORM_TEST_XLA_OPTIMIZED=1 keeps LLVM's -O2
    # (CI's integration tier does; the README's demo runs as users run it).
    if os.environ.get("CPTRANSFORM_TEST_XLA_OPTIMIZED", "0") == "0" and \
            "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import sys  # noqa: E402

# The examples import their shared `_check` from their own folder (a script's folder is on
# sys.path); tests that import an example as `examples.<name>` need that folder too. Last
# on the path, so `examples/gemma.py` never shadows DeepMind's `gemma` package.
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.append(_EXAMPLES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# JAX's persistent compilation cache: programs that took over a second to compile are
# stored, so a second run of a tier (or the slow tier after the fast one) loads them
# instead. CPTRANSFORM_TEST_COMPILATION_CACHE names another folder, or "0" to turn it off.
_CACHE = os.environ.get("CPTRANSFORM_TEST_COMPILATION_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     ".cache", "jax"))
if _CACHE not in ("", "0"):
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

jax.config.update("jax_enable_x64", False)


def make_mesh(shape, names):
    """A mesh over the first prod(shape) devices, with Auto axis types (GSPMD elsewhere)."""
    n = int(np.prod(shape))
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    return jax.make_mesh(tuple(shape), tuple(names), axis_types=(AxisType.Auto,) * len(shape),
                         devices=devices[:n])


@pytest.fixture(params=[2, 4, 8], ids=lambda n: f"cp{n}")
def cp_mesh(request):
    """A one-axis mesh named ``cp`` of size 2, 4 and 8."""
    return make_mesh((request.param,), ("cp",))


@pytest.fixture
def mesh8():
    """All 8 devices on one ``cp`` axis."""
    return make_mesh((8,), ("cp",))


@pytest.fixture
def rng():
    """A NumPy generator seeded per test (random data, reproducible failures)."""
    return np.random.default_rng(0)


RTOL = 1e-5


def assert_tree_close(actual, expected, rtol=RTOL):
    """Each leaf equal within ``rtol`` of the leaf's largest magnitude."""
    for path, a, e in zip(jax.tree_util.tree_flatten_with_path(expected)[0],
                          jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        scale = float(jnp.max(jnp.abs(e))) or 1.0
        err = float(jnp.max(jnp.abs(a - e)))
        assert err <= rtol * scale, f"{jax.tree_util.keystr(path[0])}: {err} > {rtol} * {scale}"


def fast_every(values, every: int) -> list:
    """``values`` of a ``parametrize`` as ``pytest.param``s: every ``every``-th one (from the
    first) runs in the fast tier, the others are marked ``slow``, so the fast tier samples a
    fixed slice of the matrix and the full tier runs all of it. A tuple is one case of a
    several-name ``parametrize``."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)),
                         marks=() if i % every == 0 else pytest.mark.slow)
            for i, v in enumerate(values)]


def needs_halo() -> None:
    """Skip a test that runs the halo schedule through ``context_parallel`` where this JAX's
    XLA crashes compiling it (``compat.compiler_crash``: JAX 0.11.x), with that reason;
    ``tests/test_halo.py::test_halo_refused_where_xla_crashes`` covers the refusal."""
    from cptransform.ir import compat
    reason = compat.compiler_crash("halo")
    if reason:
        pytest.skip(reason)


def sharded_only():
    """A context in which a transform that shards less than asked (an
    :class:`~cptransform.UnshardedWarning` or :class:`~cptransform.PartlyShardedWarning`)
    raises, whatever the warning filters around it say."""
    import contextlib
    import warnings

    from cptransform import UnshardedWarning

    @contextlib.contextmanager
    def context():
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnshardedWarning)
            yield
    return context()


def assert_rewritten(f, *args, count: int, **kwargs):
    """``f`` (a ``context_parallel`` function) rewrote exactly ``count`` attentions for
    these arguments (an attention in a loop body counts once) and left none whole: equal
    numbers from a program that shards less prove nothing."""
    matches = f.module(*args, **kwargs).facts.matches or ()
    rewritten = sum(m.rewritten for m in matches)
    whole = [str(m) for m in matches if m.runs_unsharded]
    assert rewritten == count and not whole, (
        f"{rewritten} attention(s) rewritten, expected {count}; left whole: {whole}")
