"""Helpers the kernels share: MSL snippets, the backend choice, kernels built once per backend."""

import os
from functools import lru_cache

import mlx.core as mx

BACKENDS = ("metal", "reference", "emulator")
PLANNED = []  # translation units recorded by backend="plan"

# Walsh-Hadamard butterflies (unnormalized, Sylvester order) over D = 32 * R values, R per lane:
# strides below R stay inside a lane, larger strides pair lane with lane ^ (stride / R).
WHT_HEADER = """
template <int R>
inline void wht_simd(thread float* v, uint lane) {
    for (int h = 1; h < R; h *= 2) {
        for (int j = 0; j < R; j++) {
            if ((j & h) == 0) {
                float a = v[j];
                float b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
    }
    for (uint m = 1; m < 32; m *= 2) {
        for (int j = 0; j < R; j++) {
            float o = simd_shuffle_xor(v[j], ushort(m));
            v[j] = (lane & m) ? o - v[j] : v[j] + o;
        }
    }
}
"""

# Code e of a packed row: BITS-bit codes, low bits first, 32 / BITS per uint32 word.
UNPACK_HEADER = """
template <int BITS>
inline uint unpack_code(const device uint32_t* row, uint e) {
    constexpr uint PER = 32 / BITS;
    return (row[e / PER] >> (BITS * (e % PER))) & ((1u << BITS) - 1u);
}
"""


def backend() -> str:
    """'metal' on Apple GPUs, else 'reference'; JUSTFIT_KERNELS=metal|reference|emulator forces one."""
    forced = os.environ.get("JUSTFIT_KERNELS", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"JUSTFIT_KERNELS must be one of {BACKENDS}, not {forced!r}")
        if forced == "metal" and not mx.metal.is_available():
            raise RuntimeError("JUSTFIT_KERNELS=metal but Metal is not available on this machine")
        return forced
    return "metal" if mx.metal.is_available() else "reference"


@lru_cache
def scalar(value: float, dtype: mx.Dtype = mx.float32) -> mx.array:
    """A cached 0-d array, which a kernel gets as a constant."""
    return mx.array(value, dtype=dtype)


class Kernel:
    """One MSL kernel, built lazily as mx.fast.metal_kernel or as an emulator kernel."""

    def __init__(self, **spec):
        self.spec = spec
        self._built = {}

    def build(self, backend: str):
        if backend not in self._built:
            if backend == "metal":
                self._built[backend] = mx.fast.metal_kernel(**self.spec)
            else:
                from .emulator import metal_kernel

                self._built[backend] = metal_kernel(**self.spec)
        return self._built[backend]

    def __call__(self, backend: str, **call):
        if backend == "plan":
            return self.plan(**call)
        return self.build(backend)(**call)

    def plan(self, *, inputs, template=None, output_shapes, output_dtypes, **_):
        """Record the emulator's translation unit for this call and return zeros (no run).

        Lets tests collect every kernel instance first and compile them in parallel.
        """
        emu = self.build("emulator")
        specs = [(x.dtype, x.shape) for x in inputs]
        PLANNED.append(emu.cpp_for(specs, list(template or []), output_dtypes))
        return [mx.zeros(tuple(s), d) for s, d in zip(output_shapes, output_dtypes)]
