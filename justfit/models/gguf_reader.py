"""Read a GGUF file's header (metadata and tensor table) in pure Python, and check JustFit can load it.

No MLX and no tensor data are touched, so a bad file is rejected with a one-line UserError before any
conversion starts. Layout (llama.cpp GGUF v2/v3, little-endian): b"GGUF", u32 version, u64 tensor count,
u64 metadata count; metadata entries (string key, u32 value type, value); tensor infos (string name,
u32 n_dims, u64 dims fastest-first, u32 ggml type, u64 offset); padding to general.alignment (default 32);
tensor data. Strings are u64 length + UTF-8 bytes.
"""

import struct
from dataclasses import dataclass, field
from pathlib import Path

from justfit.errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, elements per block, bytes per block), from ggml.h / gguf-py constants.
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
SUPPORTED_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
SUPPORTED_ARCHITECTURES = ("llama", "mistral")

# GGUF metadata value type id -> struct format of one element; 8 = string and 9 = array are special.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass
class SkippedArray:
    """Stands in for a metadata array longer than the reader's limit: element type id and length."""

    value_type: int
    length: int


@dataclass
class TensorInfo:
    """One tensor table entry; `shape` is row-major (GGUF's dims reversed), as MLX and numpy use."""

    name: str
    shape: tuple
    type_id: int
    type_name: str
    offset: int  # from the start of the tensor data section
    nbytes: int | None  # None when the type's block size is unknown


@dataclass
class GGUFHeader:
    """What `read_header` found: version, metadata, tensor table and where tensor data starts."""

    path: Path
    version: int
    metadata: dict = field(default_factory=dict)
    tensors: list = field(default_factory=list)
    data_offset: int = 0
    file_size: int = 0

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


class _Cursor:
    """Reads little-endian fields from a binary file and turns EOF into a 'truncated' UserError."""

    def __init__(self, f, path: Path):
        self.f, self.path = f, path

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise UserError(f"{self.path}: truncated GGUF file (header ends early at byte {self.f.tell()})")
        return data

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("Q")).decode("utf-8", errors="replace")

    def skip(self, n: int, size: int):
        """Skip n bytes, checking they exist in a file of `size` bytes."""
        if self.f.tell() + n > size:
            raise UserError(f"{self.path}: truncated GGUF file (header ends early at byte {size})")
        self.f.seek(n, 1)


def _read_value(cur: _Cursor, value_type: int, array_limit: int | None, size: int):
    """One metadata value; arrays longer than `array_limit` are skipped and returned as SkippedArray."""
    if value_type in _SCALARS:
        return cur.unpack(_SCALARS[value_type])
    if value_type == _STRING:
        return cur.string()
    if value_type != _ARRAY:
        raise UserError(f"{cur.path}: invalid GGUF metadata value type {value_type}")
    elem_type, length = cur.unpack("I"), cur.unpack("Q")
    if array_limit is not None and length > array_limit:
        if elem_type in _SCALARS:
            cur.skip(length * struct.calcsize("<" + _SCALARS[elem_type]), size)
        else:
            for _ in range(length):
                _read_value(cur, elem_type, 0, size)
        return SkippedArray(elem_type, length)
    if elem_type in _SCALARS:
        fmt = _SCALARS[elem_type]
        if length * struct.calcsize(fmt) > size:
            raise UserError(f"{cur.path}: truncated GGUF file (array of {length} values runs past the end)")
        return list(struct.unpack(f"<{length}{fmt}", cur.take(length * struct.calcsize(fmt))))
    return [_read_value(cur, elem_type, array_limit, size) for _ in range(length)]


def _tensor_info(cur: _Cursor) -> TensorInfo:
    name = cur.string()
    dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
    type_id, offset = cur.unpack("I"), cur.unpack("Q")
    type_name, block, block_bytes = GGML_TYPES.get(type_id, (f"type{type_id}", 0, 0))
    count = 1
    for d in dims:
        count *= d
    nbytes = count // block * block_bytes if block else None
    return TensorInfo(name, tuple(reversed(dims)), type_id, type_name, offset, nbytes)


def read_header(path, array_limit: int | None = 64) -> GGUFHeader:
    """Parse magic, version, metadata and tensor table; raise UserError if missing, not GGUF or truncated.

    Metadata arrays longer than `array_limit` become SkippedArray (None keeps them all, e.g. the vocab).
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path}: not a file (expected a .gguf file)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise UserError(f"{path}: not a GGUF file (bad magic bytes)")
        cur = _Cursor(f, path)
        version = cur.unpack("I")
        if version not in VERSIONS:
            raise UserError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
        if n_tensors > size or n_kv > size:
            raise UserError(f"{path}: truncated or corrupt GGUF header (counts exceed the file size)")
        header = GGUFHeader(path, version, file_size=size)
        for _ in range(n_kv):
            key = cur.string()
            header.metadata[key] = _read_value(cur, cur.unpack("I"), array_limit, size)
        header.tensors = [_tensor_info(cur) for _ in range(n_tensors)]
        align = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0:
            raise UserError(f"{path}: invalid general.alignment {align!r}")
        header.data_offset = -(-f.tell() // align) * align
    _check_extent(header)
    return header


def _check_extent(header: GGUFHeader):
    """Raise UserError when a tensor's data (of known size) runs past the end of the file."""
    for t in header.tensors:
        end = header.data_offset + t.offset + (t.nbytes or 0)
        if end > header.file_size:
            raise UserError(
                f"{header.path}: truncated GGUF file (tensor {t.name} needs bytes up to {end}, "
                f"file has {header.file_size})"
            )


def check_supported(path) -> GGUFHeader:
    """read_header plus JustFit's limits: a Llama-family architecture and F32/F16/Q4_0/Q4_1/Q8_0 tensors."""
    header = read_header(path)
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"{header.path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    for t in header.tensors:
        if t.type_name not in SUPPORTED_TYPES:
            raise UserError(
                f"{header.path}: unsupported GGUF tensor type {t.type_name} in tensor {t.name} "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
    return header
