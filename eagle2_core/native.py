"""Our C++ code (csrc/), built on the user's machine for that machine: the few-row product kernel
(`stream_linear`, rowgemm's `stream`) and the target's layer loop (`layers`, leanbody's native loop).

Built once per machine by torch's own extension builder (a C++ compiler and ninja; cached in
torch's extensions folder, so only the first run waits; install.sh builds it at set-up). `-march=native`: the kernel is
written with the compiler's vector extensions, so the build decides AVX-512, AVX2 or NEON from
the machine at hand, and whether it is worth running is decided by measurement (the product plan,
measure.measure_products), never by a rule per CPU. The build's name carries a digest of the CPU's
model and flags, so a cache folder shared by two machines never hands one the other's code.
Where a flag is refused the build is retried plainer; where no build works everything runs in
Python and torch's kernels, and `status()` says why.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from contextlib import contextmanager
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("products.cpp", "layers.cpp", "int8.cpp")
# tried in order: the machine's own instruction set with wide vectors and OpenMP threads (ATen's
# parallel_for is a header template: without -fopenmp it runs on one thread), then without the
# x86-only flags, then single-threaded.
FLAG_SETS = (
    ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3"],
)
_STATE: dict = {}  # "module" once built, or "error": why not (once per process)


def cpu_digest() -> str:
    """A short digest of this CPU's model and instruction-set flags (Linux: /proc/cpuinfo)."""
    text = platform.machine() + platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        text += "".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")}))
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def build_dir(name: str) -> Path:
    """Where torch's builder keeps the build `name` (its own layout: one folder per Python and
    CUDA version under the extensions root, or the root itself where TORCH_EXTENSIONS_DIR is set);
    passed to it explicitly, so the lock cleared below is the one it will look at."""
    import sys

    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / name
    accel = f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else (
        f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{accel}" / name


@contextmanager
def _one_builder(folder: Path):
    """Only one eagle2 process builds at a time (the others wait here, then find the build).

    torch's builder guards a build with a `lock` file that records no owner and that a killed
    build leaves behind, after which every later load waits on it forever. Our lock is an OS
    lock (flock), which the kernel drops when its holder dies: whoever holds it knows that no
    other eagle2 process is building, so a torch `lock` still there is stale and is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock alone
        yield
        return
    fd = os.open(folder.parent / f"{folder.name}.eagle2-build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the flock


def _clear_stale_lock(folder: Path) -> bool:
    try:
        (folder / "lock").unlink()
    except FileNotFoundError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A digest of the C++ sources: measured costs (costs.profile_key) are kept for one build of
    these kernels, so a changed kernel is measured again rather than planned from old timings."""
    h = hashlib.sha1()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:12]


def module():
    """The built module, or None where no build works here."""
    if "module" not in _STATE and "error" not in _STATE:
        from torch.utils.cpp_extension import load

        errors = []
        for i, flags in enumerate(FLAG_SETS):
            name = f"eagle2_native_{cpu_digest()}_{i}"
            try:
                folder = build_dir(name)
                with _one_builder(folder):
                    if _clear_stale_lock(folder):
                        warnings.warn("an earlier build of eagle2's kernels was stopped midway and left its lock; "
                                      "building again", stacklevel=2)
                    _STATE["module"] = load(name, [str(CSRC / s) for s in SOURCES],
                                            extra_cflags=flags, extra_ldflags=[f for f in flags if f == "-fopenmp"],
                                            extra_include_paths=[str(CSRC)], build_directory=str(folder), verbose=False)
                _STATE["flags"] = " ".join(flags)
                break
            except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a flag refused: try plainer, then give up
                errors.append((str(e).strip().splitlines() or [type(e).__name__])[0][:200])
        else:
            _STATE["error"] = errors[-1]
    return _STATE.get("module")


def is_built() -> bool:
    """Whether the build is at hand (loaded, or a finished build in torch's extensions folder),
    without building it: a first run can say that it is about to take a minute. A build from
    older sources still counts (torch rebuilds it then)."""
    if "module" in _STATE or "error" in _STATE:
        return "module" in _STATE
    return any((build_dir(name) / f"{name}.so").is_file() for name in (f"eagle2_native_{cpu_digest()}_{i}" for i in range(len(FLAG_SETS))))


def status() -> str:
    """One line: built with which flags, or why not."""
    return f"built ({_STATE['flags']})" if module() is not None else f"not built: {_STATE['error']}"
