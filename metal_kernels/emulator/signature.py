"""The kernel source MLX generates for `mx.fast.metal_kernel`, rebuilt in Python.

The emulator compiles exactly this text, so its signature must match MLX's (see the signature test).
"""

import re
from dataclasses import dataclass

import numpy as np

# Inputs with fewer elements are passed in the constant address space, as in MLX.
MAX_CONSTANT_ARRAY_SIZE = 8

TYPE_STRINGS = {
    "bool": "bool",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "float16": "float16_t",
    "bfloat16": "bfloat16_t",
    "float32": "float",
}

# (attribute, type) in MLX's order; an attribute is passed when its name occurs in the source.
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]


@dataclass
class Param:
    """One kernel parameter: a buffer (input, shape, strides, ndim, output) or an attribute."""

    kind: str  # input | shape | strides | ndim | output | attribute
    name: str
    ctype: str  # element type for buffers, the attribute type otherwise
    ref: bool = False  # passed by reference (0-d inputs, ndim)
    index: int = -1  # input or output number this buffer belongs to


def type_string(dtype) -> str:
    """MLX's Metal type name for an mx.Dtype or a dtype name."""
    name = str(dtype).replace("mlx.core.", "")
    return TYPE_STRINGS[name]


def template_text(template) -> str:
    """The `<...>` argument list MLX writes for template arguments."""
    parts = []
    for _, arg in template:
        if isinstance(arg, bool):
            parts.append("1" if arg else "0")
        elif isinstance(arg, int):
            parts.append(str(arg))
        else:
            parts.append(type_string(arg))
    return "<" + ", ".join(parts) + ">"


def kernel_name(name, template, inputs, output_dtypes) -> str:
    """MLX's kernel name: template arguments, then input and output dtypes, in the name."""
    out = "custom_kernel_" + name
    if template:
        out += "_" + re.sub(r"<|>|(, )", "_", template_text(template))[:-1]
    for dtype, shape in inputs:
        out += "_" + type_string(dtype)
        size = int(np.prod(shape)) if len(shape) else 1
        if len(shape) == 0:
            out += "s"
        elif size < MAX_CONSTANT_ARRAY_SIZE:
            out += "c"
    for dtype in output_dtypes:
        out += "_" + type_string(dtype)
    return out


def parameters(source, input_names, inputs, output_names, output_dtypes):
    """The kernel parameters in buffer order, then the attributes, as MLX lays them out."""
    params = []
    for i, (name, (dtype, shape)) in enumerate(zip(input_names, inputs)):
        ctype = type_string(dtype)
        params.append(Param("input", name, ctype, ref=len(shape) == 0, index=i))
        if len(shape) == 0:
            continue
        if name + "_shape" in source:
            params.append(Param("shape", name + "_shape", "int", index=i))
        if name + "_strides" in source:
            params.append(Param("strides", name + "_strides", "int64_t", index=i))
        if name + "_ndim" in source:
            params.append(Param("ndim", name + "_ndim", "int", ref=True, index=i))
    for i, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        params.append(Param("output", name, type_string(dtype), index=i))
    for attr, ctype in ATTRIBUTES:
        if attr in source:
            params.append(Param("attribute", attr, ctype))
    return params


def _param_line(p, buffer, inputs):
    if p.kind == "input":
        dtype, shape = inputs[p.index]
        size = int(np.prod(shape)) if len(shape) else 1
        space = "constant" if size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if p.ref else "*"
        return f"  const {space} {p.ctype}{ref} {p.name} [[buffer({buffer})]]"
    if p.kind == "shape":
        return f"  const constant int* {p.name} [[buffer({buffer})]]"
    if p.kind == "strides":
        return f"  const constant int64_t* {p.name} [[buffer({buffer})]]"
    if p.kind == "ndim":
        return f"  const constant int& {p.name} [[buffer({buffer})]]"
    return f"  device {p.ctype}* {p.name} [[buffer({buffer})]]"


def kernel_source(name, header, source, params, template, inputs):
    """The full Metal source MLX would compile (and print with verbose=True)."""
    text = header
    if template:
        kinds = []
        for tname, arg in template:
            kind = "bool" if isinstance(arg, bool) else "int" if isinstance(arg, int) else "typename"
            kinds.append(f"{kind} {tname}")
        text += "template <" + ", ".join(kinds) + ">\n"
    text += f"[[kernel]] void {name}(\n"
    buffers = [p for p in params if p.kind != "attribute"]
    attrs = [p for p in params if p.kind == "attribute"]
    lines = [_param_line(p, i, inputs) for i, p in enumerate(buffers)]
    lines += [f"  {p.ctype} {p.name} [[{p.name}]]" for p in attrs]
    text += ",\n".join(lines) + ") {\n"
    text += source + "\n}\n"
    if template:
        inst = name + template_text(template)
        text += (
            f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
        )
    return text
