"""Run MLX Metal kernels on the CPU: the same source compiled as C++20 with g++ and a shim."""

from .build import BuildError, cache_dir, compiler
from .kernel import DEFAULT_ORDERS, EmulatorError, MetalKernel, metal_kernel


def available() -> bool:
    """True when g++ is present, which is all the emulator needs."""
    return compiler() is not None


__all__ = ["BuildError", "DEFAULT_ORDERS", "EmulatorError", "MetalKernel", "available",
           "cache_dir", "compiler", "metal_kernel"]
