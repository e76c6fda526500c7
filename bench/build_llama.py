"""Builds llama.cpp's `llama-server` for this very CPU (-march=native) and caches it: the strongest llama.cpp peer.

The prebuilt peers (bench/llama_server.py's ``binary`` and ``xllamacpp`` wheels) are compiled for some other
machine's ISA: one for an AVX-512/AMX host (SIGILL elsewhere), the other for any AVX2 CPU (so no AVX-512 or
VNNI kernels on a machine that has them). A native build is what a llama.cpp user would run here.

Sources: the llama.cpp tree vendored in the `llama-cpp-python` sdist on PyPI (vendor/llama.cpp), fetched with
`pip download`, the only network this script uses. Build: cmake + ninja (from this interpreter's environment,
pip-installed if missing), Release, GGML_NATIVE=ON, no GPU backend, static libraries, no curl/OpenSSL, no web UI
download, only the `llama-server` target, 2 parallel jobs.

Cache: $XDG_CACHE_HOME/nodeserve/llama-native/<key>/ (default ~/.cache/...) holding `llama-server`, `info.json`
(versions, CPU flags, build time) and `build.log`. The key hashes the sdist version, the compilers' versions, the
cmake arguments and the `flags` line of /proc/cpuinfo: another CPU or compiler gets its own build. A second run
only computes the key and reads info.json.

    python bench/build_llama.py            # build if needed, print the binary's path
    python bench/build_llama.py --check    # also: does the binary hold 512-bit (zmm) and VNNI instructions?
    python bench/build_llama.py --info     # the cached build's info.json
    python bench/build_llama.py --cpu-class avx2 --check   # the AVX2 class build (no AVX-512 code), see CPU_CLASSES

`--cpu-class avx2` builds what an AVX2-only machine's native build has (GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C/BMI2 on,
AVX-VNNI, AVX-512 and AMX off) on any machine: bench/compare.py --cpu-class avx2 serves it against nodeserve
forced to its AVX2 kernels. It is cached under its own key.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

# The newest llama-cpp-python on PyPI when this was written. Its sdist vendors llama.cpp as a shallow git
# checkout, so llama.cpp's own build-info would say "b1"; the release number is pinned here instead
# (0c1e57098 is llama.cpp release b11312).
SDIST = ("llama-cpp-python", "0.3.36")
LLAMA_CPP = {"commit": "0c1e570", "build": 11312}
JOBS = 2
TARGET = "llama-server"

CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",              # -march=native: every ISA extension this CPU has
    "-DBUILD_SHARED_LIBS=OFF",       # one self-contained binary to cache
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",  # no model downloads or HTTPS: it serves a local GGUF on loopback
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # else configure fetches the web UI from Hugging Face
    "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF", "-DGGML_HIP=OFF", "-DGGML_SYCL=OFF",
    "-DGGML_BLAS=OFF",               # the CPU backend's own kernels, the ones nodeserve competes with
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP['build']}", f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP['commit']}",
)

# CPU classes a build can target instead of this CPU (--cpu-class): ggml's own ISA switches, GGML_NATIVE off, and the
# extensions of GGML_ISA the class has (what label() names). avx2: Haswell .. Zen 3, x86-64-v3 (AVX2, FMA, F16C,
# BMI2), as an AVX2-only machine's -march=native build has them.
CPU_CLASSES = {
    "avx2": (("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON",
              "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
              "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF",
              "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"), ("avx", "avx2", "fma", "f16c")),
}

# The x86 extensions ggml's CPU backend has kernels for; the ones present are named with the build.
GGML_ISA = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512vbmi",
            "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


# ---- what the build depends on -----------------------------------------------------------------------------

def cpu_flags_line() -> str:
    """The `flags` line of /proc/cpuinfo (first CPU), '' where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def isa_flags(flags_line: str | None = None) -> list[str]:
    """The GGML_ISA extensions this CPU reports, in GGML_ISA's order."""
    have = set((cpu_flags_line() if flags_line is None else flags_line).split())
    return [f for f in GGML_ISA if f in have]


def compiler_versions() -> str:
    """First `--version` line of the C and C++ compilers cmake will pick ($CC/$CXX, else cc/c++)."""
    out = []
    for env, default in (("CC", "cc"), ("CXX", "c++")):
        exe = os.environ.get(env, default)
        try:
            p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
            out.append(f"{exe}: {p.stdout.splitlines()[0] if p.stdout else '?'}")
        except OSError as e:
            out.append(f"{exe}: {e}")
    return "; ".join(out)


def cmake_args(cpu_class: str | None = None) -> tuple[str, ...]:
    """CMAKE_ARGS for this CPU (-march=native), or with a CPU_CLASSES class's ISA switches instead."""
    if cpu_class is None:
        return CMAKE_ARGS
    return tuple(a for a in CMAKE_ARGS if a != "-DGGML_NATIVE=ON") + CPU_CLASSES[cpu_class][0]


def cache_key(compilers: str, flags_line: str, cpu_class: str | None = None) -> str:
    """16 hex digits over everything that changes the binary: sources, compilers, cmake arguments, CPU."""
    h = hashlib.sha256("\n".join([f"{SDIST[0]}=={SDIST[1]}", compilers, " ".join(cmake_args(cpu_class)),
                                  flags_line]).encode())
    return h.hexdigest()[:16]


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nodeserve", "llama-native")


# ---- the build ----------------------------------------------------------------------------------------------

def _tool(name: str) -> str:
    """cmake or ninja: this interpreter's (a venv's bin), pip-installing the PyPI package if it has none."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.isfile(here):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", name], check=True)
    return here if os.path.isfile(here) else (shutil.which(name) or name)


def download_sdist(dest: str, log: str) -> str:
    """The pinned sdist's tarball in dest. --no-binary only for it: with :all: pip would compile its build
    requirements (cmake among them) from source just to read its metadata."""
    _run_logged([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", SDIST[0],
                 f"{SDIST[0]}=={SDIST[1]}", "-d", dest], log)
    found = glob.glob(os.path.join(dest, "*.tar.gz"))
    if len(found) != 1:
        raise RuntimeError(f"pip download left {found} in {dest}")
    return found[0]


def extract_llama_cpp(tarball: str, dest: str) -> str:
    """Extracts the sdist and returns its vendor/llama.cpp directory."""
    with tarfile.open(tarball) as tf:
        tf.extractall(dest, filter="data")
    (top,) = [d for d in os.listdir(dest) if os.path.isdir(os.path.join(dest, d))]
    src = os.path.join(dest, top, "vendor", "llama.cpp")
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        raise RuntimeError(f"{tarball} has no vendor/llama.cpp")
    return src


def _run_logged(cmd: list[str], log: str) -> None:
    with open(log, "ab") as f:
        f.write(("\n$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        raise RuntimeError(f"{os.path.basename(cmd[0])} exited with {p.returncode}")


def compile_server(src: str, build: str, log: str, cpu_class: str | None = None) -> str:
    """cmake configure + ninja build of TARGET; returns the binary's path in the build tree."""
    cmake, ninja = _tool("cmake"), _tool("ninja")
    _run_logged([cmake, "-S", src, "-B", build, "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                 *cmake_args(cpu_class)], log)
    _run_logged([cmake, "--build", build, "--target", TARGET, "-j", str(JOBS)], log)
    return os.path.join(build, "bin", TARGET)


def _build_into(final: str, compilers: str, flags_line: str, quiet: bool, cpu_class: str | None = None) -> dict:
    """Builds in a scratch directory next to `final` and moves only the binary, log and info.json there, so
    a half-finished build never looks like a cached one."""
    root = os.path.dirname(final)
    with tempfile.TemporaryDirectory(prefix="build-", dir=root) as work:
        log = os.path.join(work, "build.log")
        t0 = time.perf_counter()
        if not quiet:
            print(f"building {TARGET} from {SDIST[0]} {SDIST[1]} with {JOBS} jobs (several minutes); log {log}",
                  file=sys.stderr, flush=True)
        try:
            src = extract_llama_cpp(download_sdist(os.path.join(work, "sdist"), log), os.path.join(work, "src"))
            binary = compile_server(src, os.path.join(work, "build"), log, cpu_class)
        except Exception as e:  # the scratch directory goes; its log stays for the post-mortem
            kept = final + ".failed.log"
            if os.path.exists(log):
                shutil.copy2(log, kept)
            raise RuntimeError(f"building {TARGET} failed: {e}; log in {kept}") from e
        build_s = time.perf_counter() - t0
        out = os.path.join(work, "out")
        os.makedirs(out)
        shutil.copy2(binary, os.path.join(out, TARGET))
        shutil.copy2(log, os.path.join(out, "build.log"))
        isa = isa_flags(flags_line)
        if cpu_class is not None:  # what the build may use: the class's extensions this CPU has
            isa = [f for f in isa if f in CPU_CLASSES[cpu_class][1]]
        info = {"sdist": f"{SDIST[0]}=={SDIST[1]}", "llama_cpp_commit": LLAMA_CPP["commit"],
                "llama_cpp_build": LLAMA_CPP["build"], "compilers": compilers,
                "cmake_args": list(cmake_args(cpu_class)), "cpu_class": cpu_class, "jobs": JOBS,
                "cpu_flags": flags_line, "isa": isa, "build_s": round(build_s, 1),
                "built_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        with open(os.path.join(out, "info.json"), "w") as f:
            json.dump(info, f, indent=1)
        os.rename(out, final)
    if os.path.exists(final + ".failed.log"):  # an earlier failure, fixed since
        os.remove(final + ".failed.log")
    return info


def ensure(quiet: bool = False, retry_failed: bool = True, cpu_class: str | None = None) -> dict:
    """The cached native build's info (with "binary" and "dir"), building it first if this CPU and compiler
    have none. A file lock makes a concurrent caller wait for the build instead of starting a second one.
    retry_failed=False raises at once where a build for this key failed before (its <key>.failed.log is
    there): a failing build can take minutes, too long to repeat on every server start. cpu_class: a
    CPU_CLASSES build instead of -march=native."""
    if cpu_class is not None and cpu_class not in CPU_CLASSES:
        raise ValueError(f"unknown CPU class {cpu_class!r} (known: {', '.join(CPU_CLASSES)})")
    compilers, flags_line = compiler_versions(), cpu_flags_line()
    final = os.path.join(cache_root(), cache_key(compilers, flags_line, cpu_class))
    info = _read_info(final)
    if info is None and not retry_failed and os.path.exists(final + ".failed.log"):
        raise RuntimeError(f"an earlier build failed, see {final}.failed.log (delete it to retry)")
    if info is None:
        os.makedirs(cache_root(), exist_ok=True)
        with open(final + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            info = _read_info(final) or _build_into(final, compilers, flags_line, quiet, cpu_class)
    return {**info, "dir": final, "binary": os.path.join(final, TARGET)}


def cached(cpu_class: str | None = None) -> dict | None:
    """The cached build's info for this CPU and compiler (or CPU class), or None; never builds."""
    final = os.path.join(cache_root(), cache_key(compiler_versions(), cpu_flags_line(), cpu_class))
    info = _read_info(final)
    return None if info is None else {**info, "dir": final, "binary": os.path.join(final, TARGET)}


def _read_info(final: str) -> dict | None:
    try:
        with open(os.path.join(final, "info.json")) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if os.access(os.path.join(final, TARGET), os.X_OK) else None


def label(info: dict) -> str:
    """How tables name this peer, e.g. "native b11312 (0c1e570) -march=native (avx2 fma ... avx512_vnni)"."""
    target = f"{info['cpu_class']} class (GGML_NATIVE=OFF)" if info.get("cpu_class") else "-march=native"
    return (f"native b{info['llama_cpp_build']} ({info['llama_cpp_commit']}) {target} "
            f"({' '.join(info['isa']) or 'no AVX'})")


# ---- --check ------------------------------------------------------------------------------------------------

def isa_check(binary: str) -> dict:
    """Counts of instructions in `objdump -d binary` that use zmm (512-bit) registers and of VNNI's
    vpdpbusd (u8 x s8 dot products, what ggml's quantized dot products use where the CPU has VNNI)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return {"error": "objdump not found (Debian package binutils)"}
    zmm = vnni = total = 0
    with subprocess.Popen([objdump, "-d", "--no-show-raw-insn", binary], stdout=subprocess.PIPE, text=True,
                          errors="replace") as p:
        for line in p.stdout:
            if "\t" not in line:  # labels and headers; instruction lines are "addr:\tmnemonic operands"
                continue
            total += 1
            zmm += "%zmm" in line
            vnni += "vpdpbusd" in line
    return {"instructions": total, "zmm": zmm, "vpdpbusd": vnni}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="count zmm and vpdpbusd instructions in the binary")
    ap.add_argument("--info", action="store_true", help="print the build's info.json")
    ap.add_argument("--cpu-class", choices=sorted(CPU_CLASSES), default=None,
                    help="build for this CPU class instead of -march=native")
    args = ap.parse_args()
    t = time.perf_counter()
    info = ensure(cpu_class=args.cpu_class)
    print(info["binary"])
    print(f"{label(info)}; built in {info['build_s']:.0f} s on {info['built_at']}; "
          f"this run {time.perf_counter() - t:.2f} s", file=sys.stderr)
    if args.info:
        print(json.dumps(info, indent=1))
    if args.check:
        c = isa_check(info["binary"])
        if "error" in c:
            print(f"check: {c['error']}")
            return 1
        avx512 = "avx512f" in info["isa"]
        print(f"check: {c['instructions']} instructions, {c['zmm']} use zmm registers, {c['vpdpbusd']} vpdpbusd"
              + (" (AVX-512 CPU: zmm code expected)" if avx512 else ""))
        if avx512 and c["zmm"] == 0:
            print("check FAILED: this CPU has AVX-512 but the build has no 512-bit code")
            return 1
        if args.cpu_class == "avx2" and (c["zmm"] or c["vpdpbusd"]):
            print("check FAILED: the avx2 class build holds AVX-512 or VNNI code")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
