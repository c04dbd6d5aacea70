"""Our C++ code (csrc/), built on the user's machine for that machine: the few-row product kernel
(`stream_linear`, rowgemm's `stream`) and the target's layer loop (`layers`, leanbody's native loop).

Built once per machine by torch's own extension builder (a C++ compiler and ninja; ~40 s, cached
in torch's extensions folder; install.sh builds it at set-up). `-march=native`: the kernel is
written with the compiler's vector extensions, so the build decides AVX-512, AVX2 or NEON from
the machine at hand, and whether it is worth running is decided by measurement (the product plan,
costs.measure_products), never by a rule per CPU. The build's name carries a digest of the CPU's
model and flags, so a cache folder shared by two machines never hands one the other's code.
Where a flag is refused the build is retried plainer; where no build works everything runs in
Python and torch's kernels, and `status()` says why.
"""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("products.cpp", "layers.cpp")
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


def module():
    """The built module, or None where no build works here."""
    if "module" not in _STATE and "error" not in _STATE:
        from torch.utils.cpp_extension import load

        errors = []
        for i, flags in enumerate(FLAG_SETS):
            try:
                _STATE["module"] = load(f"eagle2_native_{cpu_digest()}_{i}", [str(CSRC / s) for s in SOURCES],
                                        extra_cflags=flags, extra_ldflags=[f for f in flags if f == "-fopenmp"],
                                        extra_include_paths=[str(CSRC)], verbose=False)
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
    import os

    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    names = [f"eagle2_native_{cpu_digest()}_{i}" for i in range(len(FLAG_SETS))]
    # torch keeps each build under a folder per Python and CUDA version (py311_cpu/NAME/NAME.so)
    return any(any(root.glob(f"*/{name}/{name}.so")) or (root / name / f"{name}.so").is_file() for name in names)


def status() -> str:
    """One line: built with which flags, or why not."""
    return f"built ({_STATE['flags']})" if module() is not None else f"not built: {_STATE['error']}"
