"""Turn MLX's kernel source into a C++20 shared object with g++, cached by source hash."""

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).parent
FLAGS = ["-std=c++20", "-O1", "-fPIC", "-shared", "-Wno-attributes", "-w"]

# `threadgroup T name[N]...;` declares memory shared by a threadgroup; anything else spelled
# `threadgroup` (a pointer parameter, a cast) is only an address space and vanishes.
_TG_DECL = re.compile(
    r"\bthreadgroup\s+(?P<type>[A-Za-z_][\w:<>]*(?:\s+[A-Za-z_][\w:<>]*)*?)\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\]\s*)*);"
)

_ATTR_EXPR = {
    "thread_position_in_grid": "t.pos_grid",
    "thread_position_in_threadgroup": "t.pos_tg",
    "threadgroup_position_in_grid": "t.tg_pos",
    "threads_per_threadgroup": "t.tg_size",
    "thread_index_in_threadgroup": "t.index_tg",
    "thread_index_in_simdgroup": "t.lane",
    "simdgroup_index_in_threadgroup": "t.sg",
    "quadgroup_index_in_threadgroup": "t.index_tg / 4",
    "thread_index_in_quadgroup": "t.index_tg % 4",
    "simdgroups_per_threadgroup": "(t.tg_size.x * t.tg_size.y * t.tg_size.z + 31) / 32",
    "quadgroups_per_threadgroup": "(t.tg_size.x * t.tg_size.y * t.tg_size.z + 3) / 4",
    "threads_per_simdgroup": "32u",
    "thread_execution_width": "32u",
    "threadgroups_per_grid": "__emu::groups_dims",
    "threads_per_grid": "__emu::grid_dims",
    "grid_size": "__emu::grid_dims",
    "grid_origin": "uint3{0, 0, 0}",
    "dispatch_threads_per_threadgroup": "__emu::group_dims",
    "dispatch_simdgroups_per_threadgroup":
        "(__emu::group_dims.x * __emu::group_dims.y * __emu::group_dims.z + 31) / 32",
    "dispatch_quadgroups_per_threadgroup":
        "(__emu::group_dims.x * __emu::group_dims.y * __emu::group_dims.z + 3) / 4",
}


class BuildError(RuntimeError):
    """g++ rejected the kernel source."""


def compiler():
    """Path of g++, or None when it is missing."""
    return shutil.which(os.environ.get("CXX", "g++"))


def cache_dir() -> Path:
    """Where compiled kernels live: $JUSTFIT_HOME/kernels, else ~/.cache/justfit/kernels."""
    root = os.environ.get("JUSTFIT_HOME")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "justfit"
    return base / "kernels"


def shared_memory(source: str) -> str:
    """Rewrite threadgroup declarations into per-group guarded allocations."""
    counter = iter(range(1 << 20))

    def repl(m):
        i = next(counter)
        t = f"__tg_type_{i}"
        return (
            f"using {t} = {m['type']} {m['dims'].strip()}; "
            f"auto& {m['name']} = *reinterpret_cast<{t}*>(::__emu::tg_alloc({i}, sizeof({t})));"
        )

    return _TG_DECL.sub(repl, source)


def glue(name, params, template_args: str) -> str:
    """A C++ function that calls the kernel for one emulated thread."""
    args = []
    buffers = [p for p in params if p.kind != "attribute"]
    for i, p in enumerate(buffers):
        const = "" if p.kind == "output" else "const "
        if p.ref:
            args.append(f"*({const}{p.ctype}*)B[{i}]")
        else:
            args.append(f"({const}{p.ctype}*)B[{i}]")
    for p in params:
        if p.kind == "attribute":
            args.append(f"{p.ctype}({_ATTR_EXPR[p.name]})")
    call = ",\n      ".join(args)
    return (
        "static void __emu_body(__emu::Thread& t, void** B) {\n"
        f"  {name}{template_args}(\n      {call});\n}}\n"
        'extern "C" int emu_launch(int n, void** host, const int64_t* nbytes, const int* kinds,\n'
        "    const char** names, const unsigned* grid, const unsigned* tg, int order,\n"
        "    unsigned seed, int at_end, char* err, int errlen) {\n"
        "  return __emu::launch(__emu_body, n, host, nbytes, kinds, names, grid, tg, order,\n"
        "                       seed, at_end, err, errlen);\n}\n"
    )


def cpp_text(metal_source: str, glue_text: str) -> str:
    """The translation unit: shim, the Metal source with shared memory rewritten, the glue."""
    return '#include "shim.h"\n' + shared_memory(metal_source) + "\n" + glue_text


RUNTIME_FILES = ("shim.h", "runtime.h", "runtime.cpp")
RUNTIME_LIB = "jfemu"


def _runtime_digest() -> str:
    h = hashlib.sha256()
    for f in RUNTIME_FILES:
        h.update((HERE / f).read_bytes())
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()


@lru_cache(maxsize=None)
def _header_dir(cxx: str) -> Path:
    """A cache folder with the shim headers, their precompiled header and the runtime library.

    Kernels link the runtime (scheduler, guarded buffers, faults) instead of compiling it each
    time, and include the precompiled shim: together about half of a kernel's compile time.
    """
    d = cache_dir() / f"rt-{_runtime_digest()[:16]}"
    lib = d / f"lib{RUNTIME_LIB}.so"
    if lib.exists() and (d / "shim.h.gch").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    for f in RUNTIME_FILES:
        shutil.copyfile(HERE / f, d / f)
    tag = os.getpid()
    r = subprocess.run([cxx, *FLAGS, str(d / "runtime.cpp"), "-o", str(d / f"rt.{tag}")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"g++ failed for the emulator runtime:\n{r.stderr[-4000:]}")
    os.replace(d / f"rt.{tag}", lib)
    flags = [f for f in FLAGS if f != "-shared"]
    r = subprocess.run([cxx, *flags, "-x", "c++-header", str(d / "shim.h"), "-o",
                        str(d / f"gch.{tag}")], capture_output=True, text=True)
    if r.returncode == 0:
        os.replace(d / f"gch.{tag}", d / "shim.h.gch")
    return d


def compile_many(cpps, jobs=None):
    """Compile translation units in parallel threads (g++ runs outside the GIL); cache them."""
    from concurrent.futures import ThreadPoolExecutor

    todo = [c for c in dict.fromkeys(cpps) if not object_path(c).exists()]
    if todo and compiler() is not None:
        _header_dir(compiler())
        with ThreadPoolExecutor(jobs or os.cpu_count() or 2) as pool:
            list(pool.map(_compile, todo))
    return len(todo)


def object_path(cpp: str) -> Path:
    """The cached shared object for a translation unit: named by the hash of source and shim."""
    key = hashlib.sha256((_runtime_digest() + cpp).encode()).hexdigest()[:24]
    return cache_dir() / f"{key}.so"


def _compile(cpp: str) -> Path:
    """Compile one translation unit into the cache unless it is there; returns the .so path."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("g++ not found: the Metal emulator needs a C++20 compiler")
    out = object_path(cpp)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(cpp)
        so = Path(tmp) / "kernel.so"
        rt = _header_dir(cxx)
        r = subprocess.run([cxx, *FLAGS, f"-I{rt}", str(src), "-o", str(so), f"-L{rt}",
                            f"-l{RUNTIME_LIB}", f"-Wl,-rpath,{rt}"], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"g++ failed for the kernel source:\n{r.stderr[-4000:]}")
        os.replace(so, out)
    return out


@lru_cache(maxsize=None)
def load(cpp: str):
    """Compile (or reuse from the cache) and dlopen a translation unit; returns its emu_launch."""
    lib = ctypes.CDLL(str(_compile(cpp)))
    fn = lib.emu_launch
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_char_p),
        ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint), ctypes.c_int,
        ctypes.c_uint, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
    ]
    return fn
