"""Configuration dataclasses and the on-disk home (JUSTFIT_HOME)."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FORMATS = ("affine", "rotated")
KEY_FORMATS = FORMATS + ("channel",)  # channel: per-channel key quantization along tokens (keys only)
OFF = ("0", "off", "false", "no")
REPETITION_WINDOW = 256  # tokens the repetition, presence and frequency penalties look back over: mlx-lm's 20
# let any sentence longer than 20 tokens repeat unpenalized, so a long greedy story looped on one paragraph


def switched_off(name: str) -> bool:
    """True when environment variable `name` says off (0, off, false or no, in any case); unset means on.
    Read at every call, so one process can compare both settings."""
    return os.environ.get(name, "1").strip().lower() in OFF


@dataclass(frozen=True)
class KVConfig:
    """How KVExec stores the KV cache: bits 16 (full precision), 8 or 4; format affine|rotated."""

    bits: int = 4
    format: str = "affine"
    group_size: int = 64
    page_size: int = 256
    quantized_kv_start: int = 256  # first page full precision: sinks + system prompt (measured: top1 0.93 -> 0.98)
    key_format: Optional[str] = None  # keys in another format than values (None: the default, see `keys`)
    key_bits: Optional[int] = None  # key bits when they differ (8-bit keys + 4-bit values: a measured comparison)
    float_pages: int = 1  # sealed pages before each query's own that attention reads from a float copy (measured:
    # document KL 0.0077 -> 0.0021); in memory only, pages on disk stay quantized; the batch scheduler runs without it

    def __post_init__(self):
        from .errors import UserError

        if self.bits not in (4, 8, 16):
            raise UserError(f"KV bits must be 4, 8 or 16, not {self.bits}")
        if self.format not in FORMATS:
            raise UserError(f"KV format must be one of {FORMATS}, not {self.format!r}")
        if self.format == "rotated" and self.bits != 4:
            raise UserError("the rotated KV format is 4-bit only")
        if self.group_size not in (32, 64, 128):
            raise UserError(f"KV group size must be 32, 64 or 128, not {self.group_size}")
        if self.key_format is not None and self.key_format not in KEY_FORMATS:
            raise UserError(f"KV key format must be one of {KEY_FORMATS}, not {self.key_format!r}")
        if self.key_bits is not None and (self.key_bits not in (4, 8) or self.bits == 16):
            raise UserError("KV key bits must be 4 or 8, with quantized values (bits 4 or 8)")
        if self.key_format == "rotated" and self.key_bits not in (None, 4):
            raise UserError("rotated keys are 4-bit only")
        if not 0 <= self.float_pages <= 8:
            raise UserError(f"float pages must be between 0 and 8, not {self.float_pages}")
        if self.page_size <= 0 or self.page_size % 32:
            raise UserError(f"page size must be a positive multiple of 32, not {self.page_size}")

    @property
    def keys(self) -> str:
        """The key format in use: `key_format`, else channel keys for 4-bit affine (measured: document KL
        0.039 -> 0.009 at the same bytes and speed), else the value format."""
        if self.key_format is not None:
            return self.key_format
        return "channel" if self.bits == 4 and self.format == "affine" else self.format

    @property
    def name(self) -> str:
        """Short label such as 'q4-affine' or 'fp16', used in fingerprints and bench rows."""
        if self.bits == 16:
            return "fp16"
        name = f"q{self.bits}-{self.format}"
        if self.keys != self.format or (self.key_bits or self.bits) != self.bits:
            name += f"-k{self.key_bits or self.bits}-{self.keys}"
        return name


def home(path: Optional[os.PathLike] = None) -> Path:
    """The JustFit home: the argument, else $JUSTFIT_HOME, else ~/.cache/justfit."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get("JUSTFIT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "justfit"


def writable_home(path: Optional[os.PathLike] = None) -> Path:
    """Create the home if needed and check it is writable; a clear UserError otherwise."""
    from .errors import UserError

    root = home(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"JUSTFIT_HOME {root} is not writable ({e.strerror}); set JUSTFIT_HOME to a writable folder"
        ) from None
    return root
