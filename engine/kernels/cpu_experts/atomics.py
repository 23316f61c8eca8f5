"""Atomic int32 operations on raw addresses, and a spin wait, as numba intrinsics."""

from __future__ import annotations

import platform

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from engine.kernels.cpu_experts.llvm import I32

_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _int32_at(builder, address):
    return builder.inttoptr(address, I32.as_pointer())


@intrinsic
def _load_acquire(typingctx, address):
    """The int32 at `address`, read with acquire order (what was written before its release is visible)."""

    def codegen(context, builder, signature, args):
        value = builder.load_atomic(_int32_at(builder, args[0]), "acquire", 4)
        return builder.sext(value, ir.IntType(64))

    return types.int64(types.intp), codegen


@intrinsic
def _fetch_add(typingctx, address, value):
    """Atomically add `value` to the int32 at `address`; the value before."""

    def codegen(context, builder, signature, args):
        old = builder.atomic_rmw("add", _int32_at(builder, args[0]), builder.trunc(args[1], I32), "seq_cst")
        return builder.sext(old, ir.IntType(64))

    return types.int64(types.intp, types.int64), codegen


@intrinsic
def _raise_to(typingctx, address, value):
    """Atomically raise the int32 at `address` to `value` (release order); a stale writer cannot lower it."""

    def codegen(context, builder, signature, args):
        builder.atomic_rmw("max", _int32_at(builder, args[0]), builder.trunc(args[1], I32), "release")
        return context.get_dummy_value()

    return types.void(types.intp, types.int64), codegen


@intrinsic
def _pause(typingctx):
    """A spin-wait hint (x86's pause: the sibling hyper-thread gets the core, less power); nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if _X86:
            fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _bytes_at(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.CPointer(types.uint8)(types.intp), codegen


@numba.njit(nogil=True, cache=True)
def _wait_for(address, target, cancel_at):
    """Spin until the int32 at `address` reaches `target`; its value, or -1 once cancel is set."""
    while True:
        value = _load_acquire(address)
        if value >= target:
            return value
        if _load_acquire(cancel_at) != 0:
            return -1
        _pause()
