"""`metal_kernel` with mx.fast.metal_kernel's interface, run on the CPU by the emulator.

Each call runs the grid in several thread orders (forward, reverse, shuffled), with buffers placed
against the end guard page and then the start one, and outputs pre-filled with two different NaN
patterns; it raises EmulatorError on a fault, a divergent barrier/simd op, an unwritten output
element or outputs that depend on the order.
"""

import ctypes

import mlx.core as mx
import numpy as np

from . import build, signature

ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}
DEFAULT_ORDERS = ("forward", "reverse", "shuffle")

# Two fills per element size, both NaN for float types, so unwritten elements are detectable.
_FILLS = {
    1: (b"\xff", b"\x5a"),
    2: (b"\xff\xff", b"\xc1\x7f"),
    4: (b"\xff\xff\xff\xff", b"\xd1\xba\xc1\x7f"),
    8: (b"\xff" * 8, b"\xd1\xba\xd1\xba\xd1\xba\xf8\x7f"),
}


class EmulatorError(RuntimeError):
    """The emulator caught a kernel bug (or could not build the kernel)."""


def _to_host(x):
    """(numpy array, mx dtype) for an mx or numpy input; bfloat16 travels as uint16 bits."""
    if isinstance(x, mx.array):
        dtype = x.dtype
        a = np.array(x.view(mx.uint16) if dtype == mx.bfloat16 else x)
    else:
        a = np.asarray(x)
        dtype = mx.array(np.zeros((), a.dtype)).dtype
    # np.ascontiguousarray would turn a 0-d array into 1-d, which changes the signature.
    return (a if a.flags.c_contiguous else a.copy()), dtype


def _np_dtype(dtype):
    if dtype == mx.bfloat16:
        return np.uint16
    return np.dtype(str(dtype).replace("mlx.core.", ""))


def _to_mx(a, dtype):
    if dtype == mx.bfloat16:
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a)


class MetalKernel:
    """A kernel built from MSL source, callable like the object mx.fast.metal_kernel returns."""

    def __init__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False):
        if atomic_outputs:
            raise EmulatorError("atomic_outputs is not emulated")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header

    def source_for(self, specs, template, output_dtypes):
        """(kernel name, parameters, full Metal source) for inputs given as (dtype, shape)."""
        specs = [(dtype, tuple(shape)) for dtype, shape in specs]
        name = signature.kernel_name(self.name, template, specs, output_dtypes)
        params = signature.parameters(
            self.source, self.input_names, specs, self.output_names, output_dtypes
        )
        text = signature.kernel_source(name, self.header, self.source, params, template, specs)
        return name, params, text

    def cpp_for(self, specs, template, output_dtypes):
        """The C++ translation unit the emulator compiles for these argument types."""
        name, params, text = self.source_for(specs, template, output_dtypes)
        targs = signature.template_text(template) if template else ""
        return build.cpp_text(text, build.glue(name, params, targs))

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None,
                 orders=DEFAULT_ORDERS, seed=0):
        template = list(template or [])
        host = [_to_host(x) for x in inputs]
        name, params, text = self.source_for([(d, a.shape) for a, d in host], template,
                                             output_dtypes)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```")
        try:
            launch = build.load(self.cpp_for([(d, a.shape) for a, d in host], template,
                                             output_dtypes))
        except build.BuildError as e:
            raise EmulatorError(str(e)) from None
        bufs, kinds, names = self._buffers(params, host)
        outs = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            outs.append(np.empty(tuple(shape), dtype=_np_dtype(dtype)))
        results = []
        for k, order in enumerate(orders):
            for o in outs:
                self._fill(o, init_value, k % 2)
            self._run(launch, params, bufs, outs, kinds, names, grid, threadgroup,
                      ORDERS[order], seed + k, k % 2 == 0, order)
            results.append([o.copy() for o in outs])
        self._check(results, orders, init_value)
        return [_to_mx(a, d) for a, d in zip(results[0], output_dtypes)]

    def _buffers(self, params, host):
        bufs, kinds, names = [], [], []
        for p in params:
            if p.kind in ("output", "attribute"):
                continue
            a, _ = host[p.index]
            if p.kind == "input":
                bufs.append(a)
            elif p.kind == "shape":
                bufs.append(np.array(a.shape, dtype=np.int32))
            elif p.kind == "strides":
                bufs.append(np.array([s // a.itemsize for s in a.strides], dtype=np.int64))
            else:
                bufs.append(np.array(a.ndim, dtype=np.int32))
            kinds.append(0)
            names.append(p.name)
        return bufs, kinds, names

    @staticmethod
    def _fill(o, init_value, which):
        if init_value is not None:
            o[...] = init_value
        else:
            o.view(np.uint8).reshape(-1)[:] = np.frombuffer(
                _FILLS[o.itemsize][which] * o.size, dtype=np.uint8
            )

    def _run(self, launch, params, bufs, outs, kinds, names, grid, tg, order, seed, at_end, label):
        arrays = bufs + outs
        kinds = kinds + [1] * len(outs)
        names = names + self.output_names
        n = len(arrays)
        ptrs = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
        sizes = (ctypes.c_int64 * n)(*[a.nbytes for a in arrays])
        ck = (ctypes.c_int * n)(*kinds)
        cn = (ctypes.c_char_p * n)(*[s.encode() for s in names])
        g = (ctypes.c_uint * 3)(*grid)
        t = (ctypes.c_uint * 3)(*tg)
        err = ctypes.create_string_buffer(1024)
        rc = launch(n, ptrs, sizes, ck, cn, g, t, order, seed, int(at_end), err, 1024)
        if rc:
            raise EmulatorError(f"{self.name} ({label} order): {err.value.decode()}")

    def _check(self, results, orders, init_value):
        for i, name in enumerate(self.output_names):
            first = results[0][i]
            if init_value is None and len(results) > 1:
                a = results[0][i].view(np.uint8).reshape(first.size, -1)
                b = results[1][i].view(np.uint8).reshape(first.size, -1)
                fa = np.frombuffer(_FILLS[first.itemsize][0], dtype=np.uint8)
                fb = np.frombuffer(_FILLS[first.itemsize][1], dtype=np.uint8)
                unwritten = (a == fa).all(1) & (b == fb).all(1)
                if unwritten.any():
                    idx = np.unravel_index(int(np.argmax(unwritten)), first.shape)
                    raise EmulatorError(
                        f"{self.name}: output '{name}' has {int(unwritten.sum())} element(s) "
                        f"never written, first at index {tuple(int(j) for j in idx)}"
                    )
            for k in range(1, len(results)):
                other = results[k][i]
                diff = first.view(np.uint8).reshape(first.size, -1) != other.view(
                    np.uint8).reshape(first.size, -1)
                diff = diff.any(1)
                if diff.any():
                    idx = np.unravel_index(int(np.argmax(diff)), first.shape)
                    raise EmulatorError(
                        f"{self.name}: output '{name}' depends on the thread order "
                        f"({orders[0]} vs {orders[k]} differ in {int(diff.sum())} element(s), "
                        f"first at {tuple(int(j) for j in idx)}): a race, a missing barrier or "
                        f"an uninitialized read"
                    )


def metal_kernel(name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False):
    """Same arguments as mx.fast.metal_kernel; the result runs on the emulator."""
    return MetalKernel(name, input_names, output_names, source, header,
                       ensure_row_contiguous, atomic_outputs)
