"""Every Triton kernel reads only globals the compiler accepts.

Triton's compiler refuses a jitted function that reads a plain module-level number ("Cannot access global variable
... from within @jit'ed function": only `tl.constexpr` globals, other jitted functions and modules), but its CPU
interpreter (TRITON_INTERPRET=1, how CPU CI runs the kernels) accepts it. That gap let `kv_cache_dtype: fp8` pass
every CPU test and kill the worker at start on an H200 (engine.kernels.kv_store's FP8_MAX). This test reads each
kernel's global names, so the CPU catches it.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import triton.language as tl
from triton.runtime.jit import KernelInterface

import engine.kernels

PLAIN_VALUES = (int, float, bool, str, bytes, tuple, list, dict, set)


def jitted_functions():
    for info in pkgutil.iter_modules(engine.kernels.__path__):
        module = importlib.import_module(f"engine.kernels.{info.name}")
        for name, value in vars(module).items():
            # a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction: both wrap the Python function `fn`
            if isinstance(value, KernelInterface) and value.fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", value


def test_the_kernels_are_found():
    names = {name for name, _ in jitted_functions()}
    assert "engine.kernels.kv_store._store_kv_kernel" in names and "engine.kernels.e4m3.to_e4m3" in names


def test_kernels_read_only_constexpr_globals():
    bad = []
    for name, fn in jitted_functions():
        code: types.CodeType = fn.fn.__code__
        for global_name in code.co_names:
            value = fn.fn.__globals__.get(global_name)
            if isinstance(value, PLAIN_VALUES) and not isinstance(value, tl.constexpr):
                bad.append(f"{name} reads {global_name} = {value!r}")
    assert not bad, "wrap in tl.constexpr (the compiler refuses them, the interpreter does not): " + "; ".join(bad)
