"""Domains declared in YAML (data/loading.py), chat-template rendering (data/text.py), mixtures and the serving
handoff: every format x record shape, rendering equal to ``apply_chat_template``, bad files named with the fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data.text import REFERENCE_CHAT_TEMPLATE, Renderer, decode_messages, plain_render
from data.loading import build_domain, declare, extra_domain
from core.errors import DataFormatError, DataSourceError, UnknownDomainError
from data.loading import DataOptions, eval_prompts, iter_examples, load_domain
from data.loading import get_domain
from data.loading import assign_split

ROOT = Path(__file__).resolve().parents[2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _conv(i: int) -> list[tuple[str, str]]:
    turns = [("system", "Be brief.")] if i % 2 else []
    turns += [("user", f"question {i}?"), ("assistant", f"answer {i}.")]
    if i % 3 == 0:
        turns += [("user", f"and then {i}?"), ("assistant", f"then {i + 1}.")]
    return turns


def _record(shape: str, i: int) -> dict:
    conv = _conv(i)
    if shape == "text":
        return {"id": f"r{i}", "text": f"plain text number {i}."}
    if shape == "prompt_completion":
        return {"id": f"r{i}", "prompt": f"question {i}?", "completion": f"answer {i}."}
    if shape == "messages":
        return {"id": f"r{i}", "messages": [{"role": r, "content": c} for r, c in conv]}
    return {"id": f"r{i}", "conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(r, r), "value": c}
                                             for r, c in conv]}


def _write(fmt: str, shape: str, folder: Path, n: int) -> Path:
    import datasets

    recs = [_record(shape, i) for i in range(n)]
    if fmt == "jsonl":
        p = folder / "d.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    elif fmt == "json":
        p = folder / "d.json"
        p.write_text(json.dumps(recs, indent=1))
    elif fmt == "csv":
        p = folder / "d.csv"
        keys = list(recs[0])
        p.write_text(",".join(keys) + "\n" + "".join(",".join(r[k] for k in keys) + "\n" for r in recs))
    elif fmt == "parquet":
        p = folder / "d.parquet"
        datasets.Dataset.from_list(recs).to_parquet(str(p))
    elif fmt == "disk":
        p = folder / "saved"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(recs)}).save_to_disk(str(p))
    else:  # text: one paragraph per record
        p = folder / "d.txt"
        p.write_text("\n\n".join(r["text"] for r in recs) + "\n")
    return p


COMBOS = [(f, s) for f in ("jsonl", "json", "csv", "parquet", "disk", "text")
          for s in ("text", "prompt_completion", "messages", "conversations")
          if not (f == "text" and s != "text") and not (f == "csv" and s in ("messages", "conversations"))]


@pytest.mark.parametrize("fmt,shape", COMBOS)
def test_every_format_and_shape_loads_and_splits_deterministically(tmp_path, fmt, shape):
    n = 24
    path = _write(fmt, shape, tmp_path, n)
    spec = {"files": [{"path": str(path), "shape": shape, **({} if fmt == "text" else {"id_field": "id"})}]}
    dom = build_domain("mine", spec, "test")
    opts = DataOptions(root=str(tmp_path), validation_fraction=0.2, test_fraction=0.3)
    first = load_domain(dom, opts)
    again = load_domain(build_domain("mine", spec, "test"), opts)
    assert {k: v.to_dict() for k, v in first.items()} == {k: v.to_dict() for k, v in again.items()}
    rows = [r for s in first.values() for r in s]
    assert len(rows) == n
    for split, ds in first.items():
        for r in ds:  # the split is a function of the record id alone
            assert assign_split(r["id"], 0.2, 0.3) == split
    by_id = {r["id"].rsplit("/", 1)[1]: r for r in rows}
    key = (lambda i: str(i - 1)) if fmt == "text" else (lambda i: f"r{i - 1}")
    r = by_id[key(1)]
    if shape == "text":
        assert r["prompt"] == "plain text number 0." and r["completion"] == "" and r["messages"] == ""
    else:
        conv = _conv(0) if shape != "prompt_completion" else [("user", "question 0?"), ("assistant", "answer 0.")]
        assert decode_messages(r["messages"]) == conv
        assert (r["prompt"], r["completion"]) == plain_render(conv)


def test_user_split_files_and_hashed_split_side_by_side(tmp_path):
    a = _write("jsonl", "messages", tmp_path, 40)
    b = tmp_path / "val.jsonl"
    b.write_text(a.read_text())
    spec = {"files": [{"path": str(a), "shape": "messages", "id_field": "id", "split": "train"},
                      {"path": str(b), "shape": "messages", "id_field": "id", "split": "validation", "name": "v"}]}
    ds = load_domain(build_domain("mine", spec, "test"), DataOptions(root=str(tmp_path), validation_fraction=0.2))
    src = {s: [i.split("/")[1] for i in ds[s]["id"]] for s in ds}
    assert src["test"] == []  # a "train" file never reaches test, a "validation" file is all validation
    assert src["validation"].count("v") == 40 and "v" not in src["train"]
    assert 0 < src["validation"].count("d") < 40 and src["train"].count("d") == 40 - src["validation"].count("d")


# --------------------------------------------------------------------------------------------- chat template
@pytest.fixture(scope="module")
def ref_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ROOT / "models" / "assets" / "reference_target"))


def test_messages_render_exactly_as_apply_chat_template_multi_turn(ref_tokenizer):
    import copy

    tok = copy.deepcopy(ref_tokenizer)
    tok.chat_template = CHATML
    render = Renderer(tok)
    assert render.format == "chat_template"
    for i in range(6):
        conv = _conv(i)
        msgs = [{"role": r, "content": c} for r, c in conv]
        p, c = render("unused", "unused", conv)
        assert p == tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        assert p + c == tok.apply_chat_template(msgs, tokenize=False)
        assert c == f"{conv[-1][1]}<|im_end|>\n"
    # a conversation ending with a user turn is a prompt only
    assert render("x", "", [("user", "hi")]) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "")
    # records without messages (code, QA, text) become a user turn of a chat model (an instruct model sent the raw
    # text answers its end-of-turn token at once); the reference target, trained on the raw text, gets them unchanged
    assert render("def f():", " return 1", None) == (
        "<|im_start|>user\ndef f():<|im_end|>\n<|im_start|>assistant\n", "return 1<|im_end|>\n")
    assert render("Question: Why?\nAnswer:", "", None) == (
        "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n", "")
    assert Renderer(ref_tokenizer)("def f():", " return 1", None) == ("def f():", " return 1")
    assert render("Question:\nAnswer:", "", None)[0] == "<|im_start|>user\nQuestion:<|im_end|>\n<|im_start|>assistant\n"


def test_training_text_and_teacher_prompts_are_what_the_target_sees(ref_tokenizer, tmp_path, monkeypatch):
    """domain_blocks (training text) and domain_prompts (teacher / selection prompts) go through the template."""
    import copy

    from data.blocks import domain_blocks, domain_prompts

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    tok = copy.deepcopy(ref_tokenizer)
    tok.chat_template = CHATML
    path = _write("jsonl", "messages", tmp_path, 30)
    decl = tmp_path / "decl"
    decl.mkdir()
    (decl / "tmpl.yaml").write_text(f"files:\n  - path: {path}\n    shape: messages\n    id_field: id\n")
    monkeypatch.setenv("SPECDRAFT_DOMAIN_DIRS", str(decl))
    opts = DataOptions(root=str(tmp_path), validation_fraction=0.0, test_fraction=0.0)
    text = tok.decode(domain_blocks("tmpl", "train", tok, 32, opts).flatten().tolist())
    assert "<|im_start|>assistant\nanswer" in text and "Assistant:" not in text
    prompts = domain_prompts("tmpl", "train", opts, 5, tok)
    assert all(p.endswith("<|im_start|>assistant\n") for p in prompts)
    plain = tok.decode(domain_blocks("tmpl", "train", ref_tokenizer, 32, opts).flatten().tolist())
    assert "Assistant: answer" in plain  # another rendering: another cache entry, not the templated one


def test_plain_fallback_without_a_template(ref_tokenizer):
    import copy

    tok = copy.deepcopy(ref_tokenizer)
    tok.chat_template = None
    render = Renderer(tok)
    assert render.format == "plain"
    conv = _conv(3)
    assert render(*plain_render(conv), conv) == plain_render(conv)
    assert plain_render(conv) == ("Be brief.\nUser: question 3?\nAssistant: answer 3.\nUser: and then 3?\n"
                                  "Assistant:", " then 4.")


_text = st.text(st.characters(codec="utf-8", exclude_characters="{}%#"), max_size=30)


@settings(max_examples=25, deadline=None)
@given(_text, st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), _text), max_size=6))
def test_reference_template_renders_the_plain_format(first, rest):
    """The committed reference target's template renders what it was trained on, for any conversation (one that
    has a user turn: every record shape requires one)."""
    conv = [("user", first), *rest]
    from transformers import AutoTokenizer

    tok = _REF_TOK.get("t") or _REF_TOK.setdefault(
        "t", AutoTokenizer.from_pretrained(str(ROOT / "models" / "assets" / "reference_target")))
    assert tok.chat_template == REFERENCE_CHAT_TEMPLATE
    assert Renderer(tok)("", "", conv) == plain_render(conv)


_REF_TOK: dict = {}


def test_reference_target_sees_the_same_tokens_for_built_in_prompts(ref_tokenizer, real_data_root):
    """Rendering the built-in chat prompts with the new template changes no token of what the target is sent."""
    opts = DataOptions(root=str(real_data_root))
    for dom in ("chat", "summarization"):
        plain = eval_prompts(dom, opts, 16)
        templated = eval_prompts(dom, opts, 16, ref_tokenizer)
        assert [e.messages for e in plain] and all(e.messages for e in plain)
        assert [ref_tokenizer(e.prompt)["input_ids"] for e in plain] == \
            [ref_tokenizer(e.prompt)["input_ids"] for e in templated]


# --------------------------------------------------------------------------------------------- declarations
def test_yaml_declared_domain_works_where_built_ins_do(tmp_path, monkeypatch):
    data = _write("jsonl", "messages", tmp_path, 12)
    decl = tmp_path / "decls"
    decl.mkdir()
    (decl / "support.yaml").write_text(f"root: {tmp_path}\nfiles:\n  - path: {data.name}\n    shape: messages\n")
    monkeypatch.setenv("SPECDRAFT_DOMAIN_DIRS", str(decl))
    dom = get_domain("support")
    assert dom.name == "support" and dom.sources[0].file == str(data)
    from tinymodels import compose_config
    from train.run import validate

    rc = validate(compose_config(["data.domain=support", "eval.domains=[support,chat]",
                                  "data.mixture={support: 3, chat: 1}"]))
    assert rc.data.training_domains() == {"support": 3.0, "chat": 1.0}
    from train.stages import trainable_domain

    assert trainable_domain("support")
    with pytest.raises(UnknownDomainError) as ei:
        get_domain("suport")
    assert "support" in str(ei.value) and "suport.yaml" in str(ei.value)
    # inline declaration: data.declared_domains
    rc = validate(compose_config([f"+data.declared_domains.inline={{files: [{{path: {data}, shape: messages}}]}}",
                                  "data.domain=inline"]))
    assert get_domain("inline").sources[0].file == str(data)


BAD = {
    "bad role": ('{"messages": [{"role": "bot2", "content": "x"}]}\n', "messages", "d.jsonl:1", "role 'bot2'"),
    "missing field": ('{"text": "x"}\n', "messages", "d.jsonl:1", "field 'messages' is missing"),
    "not a list": ('{"messages": "hello"}\n', "messages", "d.jsonl:1", "non-empty list"),
    "no user turn": ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "messages", "d.jsonl:1",
                     "no user turn"),
    "sharegpt from": ('{"conversations": [{"from": "alien", "value": "x"}]}\n', "conversations", "d.jsonl:1",
                      "from 'alien'"),
    "bad json line": ('{"messages": [}\n', "messages", "d.jsonl:1", "not valid JSON"),
    "content type": ('{"messages": [{"role": "user", "content": 3}]}\n', "messages", "d.jsonl:1",
                     "must be a string"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_name_file_line_field_and_fix(tmp_path, case):
    body, shape, where, says = BAD[case]
    p = tmp_path / "d.jsonl"
    p.write_text(body)
    dom = build_domain("mine", {"files": [{"path": str(p), "shape": shape}]}, "test")
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(dom, DataOptions(root=str(tmp_path))))
    msg = str(ei.value)
    assert str(tmp_path / where) in msg and says in msg, msg


@pytest.mark.parametrize("name,content,says", [
    ("d.parquet", b"not parquet at all", "not a readable Parquet file"),
    ("d.json", b'{"a": 1}', "expected a JSON array of records"),
    ("saved", None, "not a datasets save_to_disk folder"),
])
def test_bad_files_name_the_file_and_what_to_fix(tmp_path, name, content, says):
    p = tmp_path / name
    if content is None:
        p.mkdir()
        (p / "junk.txt").write_text("x")
    else:
        p.write_bytes(content)
    dom = build_domain("mine", {"files": [{"path": str(p), "shape": "messages"}]}, "test")
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(dom, DataOptions(root=str(tmp_path))))
    assert str(p) in str(ei.value) and says in str(ei.value)


@pytest.mark.parametrize("spec,says", [
    ({"files": [{"path": "a.xlsx", "shape": "messages"}]}, "cannot tell the format"),
    ({"files": [{"path": "a.jsonl"}]}, "shape None is not one of"),
    ({"files": [{"path": "a.jsonl", "shape": "messages", "split": "dev"}]}, "split 'dev'"),
    ({"files": [{"path": "a.jsonl", "shape": "messages", "fields": "x"}]}, "unknown key(s) ['fields']"),
    ({"files": []}, "'files' must be a non-empty list"),
    ({"files": [{"format": "hub", "shape": "messages"}]}, "format hub needs hub"),
])
def test_bad_declarations_name_the_declaration_and_the_key(spec, says):
    with pytest.raises(DataFormatError) as ei:
        build_domain("mine", spec, "conf/domain/mine.yaml")
    assert "conf/domain/mine.yaml" in str(ei.value) and says in str(ei.value)


def test_missing_file_and_hub_source(tmp_path, monkeypatch):
    dom = build_domain("mine", {"files": [{"path": str(tmp_path / "nope.jsonl"), "shape": "messages"}]}, "t")
    with pytest.raises(DataSourceError) as ei:
        list(iter_examples(dom, DataOptions(root=str(tmp_path))))
    assert str(tmp_path / "nope.jsonl") in str(ei.value) and "declaration" in str(ei.value)
    hub = build_domain("mine", {"files": [{"format": "hub", "shape": "messages",
                                           "hub": {"path": "someone/chat-logs"}}]}, "t")
    with pytest.raises(DataSourceError) as ei:  # read only with data.source=hub
        list(iter_examples(hub, DataOptions(root=str(tmp_path))))
    assert "data.source=hub" in str(ei.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataSourceError) as ei:  # offline: the hub cannot be reached, said in one line
        list(iter_examples(hub, DataOptions(root=str(tmp_path), source="hub")))
    assert "could not load 'someone/chat-logs' from the hub" in str(ei.value)


def test_changing_a_declaration_changes_the_data_fingerprint(tmp_path):
    from data.loading import files_fingerprint

    path = _write("jsonl", "prompt_completion", tmp_path, 4)
    fp = [files_fingerprint(build_domain("m", {"files": [{"path": str(path), "shape": "prompt_completion", **kw}]},
                                         "t")) for kw in ({}, {"as_chat": False}, {"id_field": "id"})]
    assert len(set(fp)) == 3
    assert fp[0] == files_fingerprint(build_domain("m", {"files": [{"path": str(path), "shape": "prompt_completion"}]},
                                                   "t"))


def test_extra_domains_use_the_same_shapes(tmp_path):
    p = _write("parquet", "messages", tmp_path, 5)
    dom = extra_domain("logs", p, None, shape="messages")
    prompts = eval_prompts(dom, DataOptions(root=str(tmp_path)))
    assert len(prompts) == 5 and all(e.prompt.endswith("Assistant:") for e in prompts)


def test_inline_declaration_cannot_shadow_a_built_in():
    with pytest.raises(DataFormatError) as ei:
        declare("medical", {"files": [{"path": "a.jsonl", "shape": "text"}]})
    assert "built-in" in str(ei.value)


# --------------------------------------------------------------------------------------------- mixtures
@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from("abcde"), st.floats(0.05, 10), min_size=1, max_size=5),
       st.integers(1, 400), st.integers(0, 3))
def test_mixture_draws_blocks_in_proportion_to_its_weights(weights, total, seed):
    from data.blocks import mix_blocks, mixture_counts

    counts = mixture_counts(weights, total)
    assert sum(counts.values()) == total
    w = sum(weights.values())
    assert all(abs(counts[d] - total * weights[d] / w) < 1 for d in weights)
    # each domain's blocks are tagged by their first token; sizes differ so some domains repeat blocks
    parts = {d: torch.full((3 + 5 * i, 4), i, dtype=torch.long) for i, d in enumerate(sorted(weights))}
    for i, d in enumerate(sorted(weights)):
        parts[d][:, 1] = torch.arange(parts[d].size(0))
    mixed = mix_blocks(parts, weights, total, seed)
    assert mixed.shape == (total, 4)
    for i, d in enumerate(sorted(weights)):
        mine = mixed[mixed[:, 0] == i]
        assert mine.size(0) == counts[d]
        # a domain's blocks are used once each before any repeats
        uses = torch.bincount(mine[:, 1], minlength=parts[d].size(0))
        assert uses.max() - uses.min() <= 1
    assert torch.equal(mixed, mix_blocks(parts, weights, total, seed))


def test_mixture_config_errors():
    from tinymodels import compose_config
    from train.run import validate

    with pytest.raises(ValueError, match="weights > 0"):
        validate(compose_config(["data.mixture={medical: 0, code: 1}"]))
    with pytest.raises(ValueError, match="unknown domain 'medicall'"):
        validate(compose_config(["data.mixture={medicall: 1}"]))


# --------------------------------------------------------------------------------------------- serving
def test_serving_settings_for_each_recommendation(tmp_path):
    from eval.sections import serving_document
    from eval.decision import recommended_settings

    def entry(g, s):
        return {"num_draft_tokens": g, "measured_speedup": s}
    doc = {"recommendation": {
        "chat": {"draft": "distilled", "draft_length_policy": "fixed", "num_draft_tokens": 4, "measured_speedup": 1.8},
        "code": {"draft": "baseline", "draft_length_policy": "adaptive", "num_draft_tokens": 8,
                 "measured_speedup": 0.9}},
        "drafts": {"baseline": {"code": {"best_num_draft_tokens": 3, "sweep": {"3": entry(3, 0.8)}}}}}
    rec = recommended_settings(doc)
    assert rec["chat"]["num_draft_tokens"] == 4 and rec["chat"]["note"] == ""
    # a policy decision: engines take a fixed gamma, and the draft's only one measured 0.8x: the target alone
    assert rec["code"]["draft"] is None and rec["code"]["num_draft_tokens"] == 0 and "adaptive" in rec["code"]["note"]
    s = serving_document(doc, {"distilled": tmp_path / "d", "baseline": tmp_path / "b"}, "org/target")
    chat = s["domains"]["chat"]
    assert chat["vllm"]["speculative_config"] == {"method": "draft_model", "model": str(tmp_path / "d"),
                                                  "num_speculative_tokens": 4}
    a = chat["sglang"]["args"]
    assert a[a.index("--speculative-num-steps") + 1] == "4" and a[a.index("--speculative-eagle-topk") + 1] == "1"
    assert a[a.index("--speculative-num-draft-tokens") + 1] == "5"
    assert a[a.index("--speculative-draft-model-path") + 1] == str(tmp_path / "d")
    assert "assistant_model=draft" in chat["transformers"]["snippet"]
    assert "num_assistant_tokens = 4" in chat["transformers"]["snippet"]
    lc = chat["llama_cpp"]  # no run folder given: the drafts' GGUF exports sit in <run dir>/gguf
    assert lc["draft_gguf"] == str(tmp_path.parent / "gguf" / "d-q8_0.gguf")
    assert lc["args"][lc["args"].index("-md") + 1] == lc["draft_gguf"]
    assert lc["args"][lc["args"].index("--spec-draft-n-max") + 1] == "4" and "draft-simple" in lc["args"]
    assert lc["command"].startswith("llama-server -m ") and "scripts/export_gguf.py" in lc["export"]
    pinned = serving_document(doc, {"distilled": tmp_path / "d", "baseline": tmp_path / "b"}, "org/target",
                              gguf_dir=tmp_path / "g")
    assert pinned["domains"]["chat"]["llama_cpp"]["target_gguf"] == str(tmp_path / "g" / "target-q8_0.gguf")
    f16 = serving_document(doc, {"distilled": tmp_path / "d", "baseline": tmp_path / "b"}, "org/target",
                           gguf_dir=tmp_path / "g", formats={"target_format": "f16", "draft_format": "f16"})
    lc = f16["domains"]["chat"]["llama_cpp"]  # the files the engine check writes with eval.engine.*_format=f16
    assert lc["draft_gguf"] == str(tmp_path / "g" / "d-f16.gguf") and lc["target_gguf"].endswith("-f16.gguf")
    assert "--outtype f16" in lc["export"]
    with pytest.raises(ValueError, match="no checkpoint path"):
        serving_document(doc, {"baseline": tmp_path / "b"}, "org/target")  # chat's draft has no path
    # a domain whose verdict is the target alone gets no engine settings, and the report row says so
    from eval.sections import serving_markdown

    doc["recommendation"]["math"] = {"action": "target_only", "draft": None, "num_draft_tokens": None,
                                     "measured_speedup": 0.7, "reason": "every interval lies below 1"}
    s = serving_document(doc, {"distilled": tmp_path / "d", "baseline": tmp_path / "b"}, "org/target")
    assert s["domains"]["math"]["draft"] is None and "vllm" not in s["domains"]["math"]
    assert "target alone" in s["domains"]["math"]["note"]
    assert "| math | none (the target alone) |" in serving_markdown(s)


# --------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_smoke_trains_and_evaluates_a_domain_declared_by_one_yaml_and_one_data_file(tmp_path):
    """From the repository as cloned: one YAML file (in $SPECDRAFT_DOMAIN_DIRS) and one data file are all it takes
    for `python -m train +experiment=smoke data.domain=<it>`."""
    import shutil

    src = Path(os.environ.get("SPECDRAFT_DATA_ROOT", ROOT.parent / "shared" / "data")) / "chat"
    if not src.is_dir():
        pytest.skip("no data root")
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_byo_chat import main as make

    logs = make(["--out", str(tmp_path / "logs")])
    decl = tmp_path / "decl"
    decl.mkdir()
    (decl / "support.yaml").write_text(f"files:\n  - path: {logs / 'chat_logs.jsonl'}\n    shape: messages\n"
                                       f"    id_field: id\n")
    env = {**os.environ, "SPECDRAFT_DOMAIN_DIRS": str(decl), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "train", "+experiment=smoke", "data.domain=support",
                           "eval.domains=[support]", f"hydra.run.dir={run}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert "support" in metrics["recommendation"] and metrics["context"]["prompt_format"] == "chat_template"
    assert json.loads((run / "drafts" / "distilled" / "specdraft.json").read_text())["domain"] == "support"
    serving = json.loads((run / "serving.json").read_text())
    assert set(serving["domains"]) == {"support"}
    shutil.rmtree(run / "train", ignore_errors=True)


@pytest.mark.parametrize("name", ["a|b", "two words", "new\nline", "`tick`", "", "-lead", "x/y"])
def test_a_name_that_would_break_report_tables_or_file_names_is_refused(name):
    """Domain and draft names go into Markdown tables, plot file names and routing.json: a name with ``|``, spaces,
    slashes or backticks is a one-line error naming the key and a usable replacement, for every way to name one."""
    from data.loading import build_domain
    from eval.config import EvalConfig, ExtraDomainConfig

    spec = {"files": [{"path": "x.jsonl", "format": "jsonl", "shape": "text", "text_field": "t"}]}
    with pytest.raises(ValueError, match="not a usable name.*letters, digits"):
        build_domain(name, spec, "conf/domain/x.yaml")
    with pytest.raises(ValueError, match=r"eval.extra_domains\[\].name: .*not a usable name"):
        ExtraDomainConfig(name=name, path="x.jsonl", text_field="t")
    with pytest.raises(ValueError, match="eval.drafts: .*not a usable name"):
        EvalConfig(drafts={name: "some/dir"})


@pytest.mark.parametrize("name", ["support", "med-2", "v1.5", "Q_and_A", "7b+lora"])
def test_usual_names_are_accepted(name):
    from data.registry import check_report_name

    assert check_report_name(name, "k") == name
