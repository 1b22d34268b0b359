"""Where a ``cptransform`` command's program comes from: a Python entry point.

Jaxprs have no text parser, so a program comes from ``FILE.py:NAME``: either a
``make()``-style function (no required parameters) returning ``(fn, example_args)``, or a
function whose argument shapes are given as text (``'f32[2,64,4,16] i32[2,64]'``,
:func:`parse_shapes`). ``FILE.py`` is imported and executed, as pytest does with test files.
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from cptransform.ir.module import Module, trace


class CLIError(Exception):
    """Bad command-line input; printed as one line, exit status 2."""


def one_line(err: Exception) -> str:
    """``Type: first line of the message``: user-code errors reported on one line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


DTYPES = {
    "f16": jnp.float16, "bf16": jnp.bfloat16, "f32": jnp.float32, "f64": jnp.float64,
    "i8": jnp.int8, "i16": jnp.int16, "i32": jnp.int32, "i64": jnp.int64,
    "u8": jnp.uint8, "u16": jnp.uint16, "u32": jnp.uint32, "u64": jnp.uint64,
    "bool": jnp.bool_, "pred": jnp.bool_,
}
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,\s]*)\]")

#: Elements an argument may hold: JAX sizes arrays with signed 64-bit integers.
MAX_ELEMENTS = 2 ** 63 - 1


def parse_shapes(text: str) -> list[jax.ShapeDtypeStruct]:
    """``'f32[2,64,4,16] i32[2,64] f32[]'`` → ``jax.ShapeDtypeStruct``s."""
    out = []
    # spaces inside brackets ("i32[2, 64]") do not separate arguments
    for token in re.sub(r"\s+(?=[^\[]*\])", "", text).split():
        m = _SHAPE.fullmatch(token)
        if not m:
            raise CLIError(f"cannot read argument shape {token!r}; write dtype[dims], e.g. "
                           "f32[2,64,4,16] or i32[] for a scalar")
        dtype = DTYPES.get(m.group(1))
        if dtype is None:
            raise CLIError(f"unknown dtype {m.group(1)!r} in {token!r}; known dtypes: "
                           f"{', '.join(DTYPES)}")
        text_dims = m.group(2).replace(" ", "")
        parts = text_dims.split(",") if text_dims else []
        if any(not d for d in parts):
            raise CLIError(f"cannot read argument shape {token!r}: an empty dimension; write "
                           "dtype[dims] with one size between each comma, e.g. f32[2,64]")
        dims = tuple(int(d) for d in parts)
        if math.prod(dims) > MAX_ELEMENTS:
            raise CLIError(f"argument shape {token!r} holds {math.prod(dims)} elements, more "
                           f"than any array can ({MAX_ELEMENTS})")
        out.append(jax.ShapeDtypeStruct(dims, dtype))
    return out


def load_object(spec: str) -> tuple[Any, str]:
    """``FILE.py:NAME`` → (the object, NAME)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise CLIError(f"entry point {spec!r} must look like FILE.py:NAME, e.g. "
                       "examples/llama.py:make")
    path = Path(path_text)
    if not path.is_file():
        raise CLIError(f"no such file: {path_text}")
    # Its folder goes on sys.path (as pytest puts a test file's), so a model file can import
    # the helper modules beside it.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = f"_cptransform_entry_{path.stem}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise CLIError(f"cannot import {path_text}: not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except SystemExit as err:  # a script's own sys.exit() at import time
        raise CLIError(f"importing {path_text} called sys.exit({err.code!r}); guard its "
                       "script part with `if __name__ == \"__main__\":`") from None
    except Exception as err:  # the user's file can raise anything on import
        raise CLIError(f"importing {path_text} failed: {one_line(err)}") from None
    if not hasattr(module, name):
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module_name)
        raise CLIError(f"{path_text} has no {name!r}; its functions: {', '.join(found) or 'none'}")
    return getattr(module, name), name


def _required_params(fn: Callable) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def load_program(spec: str, args_text: str | None) -> tuple[Callable, tuple, str]:
    """Resolve an entry point to ``(fn, example_args, name)``; see the module docstring."""
    obj, name = load_object(spec)
    if not callable(obj):
        raise CLIError(f"{spec} is not a function")
    required = _required_params(obj)
    if args_text is not None:
        shapes = parse_shapes(args_text)
        if required and len(shapes) != len(required):
            raise CLIError(f"{name} takes {len(required)} arguments ({', '.join(required)}) "
                           f"but --args gives {len(shapes)}")
        return obj, tuple(shapes), name
    if required:
        raise CLIError(f"{name} takes arguments ({', '.join(required)}); give their shapes "
                       "with --args 'f32[2,64] i32[2]', or name a make() function that "
                       "returns (fn, example_args)")
    try:
        made = obj()
    except (Exception, SystemExit) as err:  # user code
        raise CLIError(f"{name}() failed: {one_line(err)}") from None
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])
            and isinstance(made[1], (tuple, list))):
        raise CLIError(f"{name}() must return (fn, example_args) with example_args a tuple")
    fn, example_args = made
    return fn, tuple(example_args), getattr(fn, "__name__", name)


def trace_program(fn: Callable, args: Sequence[Any], name: str) -> Module:
    """Trace, turning a failure in user code into a one-line error."""
    try:
        return trace(fn, *args, name=name)
    except (Exception, SystemExit) as err:  # user code can raise anything while tracing
        raise CLIError(f"tracing {name} failed: {one_line(err)}") from None
