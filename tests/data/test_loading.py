"""Loading, deterministic splits, error messages, and tokenization/packing of the data layer.

Error cases build small files in ``tmp_path`` and point ``DataOptions(root=tmp_path)`` at them; the real data root
is only read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import data.loading
from core.errors import DataFormatError, DataSourceError, UnknownDomainError
from data.loading import DataOptions, eval_prompts, files_fingerprint, iter_examples, load_domain, user_domain
from data.loading import ENV_DATA_ROOT, default_data_root, resolve_data_root
from core.io import PROJECT_ROOT
from data.loading import get_domain
from data.registry import DOMAINS, Domain
from data.loading import assign_split, hash_unit


def _source(domain: str, name: str):
    return next(s for s in get_domain(domain).sources if s.name == name)


MEDQUAD_A = _source("medical", "medquad_cancergov")
MEDQUAD_B = _source("medical", "medquad_mplus")
PUBMEDQA = _source("medical", "pubmedqa")
MTS_VALIDATION = _source("medical", "mtsdialog_validation")


def _splits(domain, root) -> dict[str, str]:
    return {ex.id: split for ex, split in iter_examples(domain, DataOptions(root=str(root)))}


# ------------------------------------------------------------------------------------------------ splits
def test_hash_unit_is_stable_in_range_and_process_independent():
    keys = [f"medical/medquad_cancergov/{i}" for i in range(50)] + ["", "ünïcödé/日本"]
    values = [hash_unit(k) for k in keys]
    assert all(0 <= v < 1 for v in values)
    assert values == [hash_unit(k) for k in keys]
    # another interpreter, with a different str-hash seed, gets the same numbers (sha256, not hash())
    code = "import json,sys; from data.loading import hash_unit; print(json.dumps([hash_unit(k) for k in json.load(sys.stdin)]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(keys), capture_output=True, text=True,
                         cwd=PROJECT_ROOT, env=env, timeout=60, check=True).stdout
    assert json.loads(out) == values
    # a pinned value guards against a silent change of the hash (which would reshuffle every split)
    assert hash_unit("medical/medquad_cancergov/0000001_1-1") == pytest.approx(0.8557733088284675, abs=1e-15)
    assert hash_unit("math/gsm8k_test/0") == pytest.approx(0.2115119222550091, abs=1e-15)


def test_assign_split_is_deterministic_and_respects_fractions():
    keys = [f"d/s/{i}" for i in range(20_000)]
    splits = [assign_split(k, 0.05, 0.1) for k in keys]
    assert splits == [assign_split(k, 0.05, 0.1) for k in keys]
    share = {s: splits.count(s) / len(keys) for s in ("train", "validation", "test")}
    assert share["test"] == pytest.approx(0.10, abs=0.01)
    assert share["validation"] == pytest.approx(0.05, abs=0.01)
    assert share["train"] == pytest.approx(0.85, abs=0.01)
    # growing the test share only moves records *into* test (the test set is nested, never reshuffled)
    bigger = [assign_split(k, 0.05, 0.2) for k in keys]
    assert all(b == "test" for s, b in zip(splits, bigger) if s == "test")
    # zero fractions: everything is train
    assert {assign_split(k, 0.0, 0.0) for k in keys[:500]} == {"train"}


def test_split_policies():
    keys = [f"d/s/{i}" for i in range(5_000)]
    assert {assign_split(k, 0.05, 0.1, "test") for k in keys} == {"test"}
    train_policy = [assign_split(k, 0.05, 0.1, "train") for k in keys]
    assert set(train_policy) == {"train", "validation"}
    assert train_policy.count("validation") / len(keys) == pytest.approx(0.05, abs=0.015)
    with pytest.raises(ValueError, match="policy"):
        assign_split("k", 0.05, 0.1, "bogus")
    for val, test in [(-0.1, 0.1), (0.05, 1.0), (0.6, 0.5)]:
        with pytest.raises(ValueError, match="data.validation_fraction"):
            assign_split("k", val, test)


def test_adding_records_and_files_never_moves_existing_records(tmp_path, write_jsonl, medquad_record):
    file_a = write_jsonl(tmp_path / MEDQUAD_A.file, [medquad_record(i) for i in range(300)])
    one_file = Domain("medical", "subset", (MEDQUAD_A,))
    before = _splits(one_file, tmp_path)
    assert len(before) == 300 and set(before.values()) == {"train", "validation", "test"}

    # append records to the file, and add a second file of the domain
    write_jsonl(file_a, [medquad_record(i) for i in range(300, 600)], mode="a")
    write_jsonl(tmp_path / MEDQUAD_B.file, [medquad_record(i) for i in range(200)])
    after = _splits(Domain("medical", "subset", (MEDQUAD_A, MEDQUAD_B)), tmp_path)
    assert len(after) == 800
    assert {k: after[k] for k in before} == before

    # reordering a file's lines changes nothing either (the split depends on the record id only)
    lines = file_a.read_text().splitlines(keepends=True)
    file_a.write_text("".join(reversed(lines)))
    assert _splits(Domain("medical", "subset", (MEDQUAD_A, MEDQUAD_B)), tmp_path) == after

    # and load_domain puts each record into the split assign_split gives it
    ds = load_domain(one_file, DataOptions(root=str(tmp_path)))
    for split in ds:
        assert all(after[i] == split for i in ds[split]["id"])


def test_split_policy_of_sources_on_synthetic_files(tmp_path):
    rows = "ID,section_header,section_text,dialogue\n" + "".join(
        f'{i},GENHX,"The patient, number {i}, is well.","Doctor: How are you?\nPatient: Fine, {i}."\n' for i in range(40)
    )
    (tmp_path / "medical").mkdir()
    (tmp_path / MTS_VALIDATION.file).write_text(rows)
    pairs = list(iter_examples(Domain("medical", "", (MTS_VALIDATION,)), DataOptions(root=str(tmp_path))))
    assert len(pairs) == 40 and {s for _, s in pairs} == {"test"}
    ex = pairs[0][0]
    assert ex.id == "medical/mtsdialog_validation/0"
    assert "Patient: Fine, 0." in ex.prompt and ex.completion == " The patient, number 0, is well."


# ------------------------------------------------------------------------------------------------ data root
def test_data_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_DATA_ROOT, str(tmp_path))
    assert default_data_root() == tmp_path
    assert resolve_data_root(None) == tmp_path
    assert resolve_data_root("null") == tmp_path
    assert resolve_data_root(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.delenv(ENV_DATA_ROOT)
    beside = PROJECT_ROOT.parent / "shared" / "data"
    assert default_data_root() == (beside if beside.is_dir() else None)


def test_env_data_root_is_used(monkeypatch, tmp_path, write_jsonl, medquad_record):
    write_jsonl(tmp_path / MEDQUAD_A.file, [medquad_record(i) for i in range(5)])
    monkeypatch.setenv(ENV_DATA_ROOT, str(tmp_path))
    pairs = list(iter_examples(Domain("medical", "", (MEDQUAD_A,))))
    assert len(pairs) == 5
    assert pairs[0][0].prompt == "Question: What causes condition number 0?\nAnswer:"
    assert pairs[0][0].completion == " Condition 0 is caused by factor 0."


def test_files_fingerprint_tracks_content(tmp_path, write_jsonl, medquad_record):
    dom = Domain("medical", "", (MEDQUAD_A,))
    f = write_jsonl(tmp_path / MEDQUAD_A.file, [medquad_record(i) for i in range(5)])
    opts = DataOptions(root=str(tmp_path))
    fp = files_fingerprint(dom, opts)
    assert fp == files_fingerprint(dom, opts) and len(fp) == 64
    write_jsonl(f, [medquad_record(99)], mode="a")
    assert files_fingerprint(dom, opts) != fp


# ------------------------------------------------------------------------------------------------ errors
def _assert_names_both_ways(msg: str):
    assert "data.root" in msg and ENV_DATA_ROOT in msg, msg


def test_missing_data_root_is_named_as_a_folder_not_a_file(tmp_path, monkeypatch):
    root = tmp_path / "does_not_exist"
    with pytest.raises(DataSourceError) as ei:
        list(iter_examples("medical", DataOptions(root=str(root))))
    msg = str(ei.value)
    assert f"data root {root} (data.root) does not exist" in msg and "missing data file" not in msg, msg
    _assert_names_both_ways(msg)
    assert "data.source=hub" in msg
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setenv(ENV_DATA_ROOT, str(tmp_path / "a_file"))
    with pytest.raises(DataSourceError, match=rf"\${ENV_DATA_ROOT}\) is a file, not a folder"):
        list(iter_examples("medical", DataOptions()))


def test_missing_file_in_an_existing_root_names_file_and_both_ways(tmp_path):
    with pytest.raises(DataSourceError) as ei:
        list(iter_examples("medical", DataOptions(root=str(tmp_path))))
    msg = str(ei.value)
    assert PUBMEDQA.file in msg and str(tmp_path) in msg
    _assert_names_both_ways(msg)
    assert "data.source=hub" in msg and "qiaojin/PubMedQA" in msg  # PubMedQA has a hub copy


def test_missing_file_without_hub_copy(tmp_path):
    (tmp_path / "medical").mkdir()
    with pytest.raises(DataSourceError) as ei:
        list(iter_examples(Domain("medical", "", (MEDQUAD_A,)), DataOptions(root=str(tmp_path))))
    msg = str(ei.value)
    assert MEDQUAD_A.file in msg and str(tmp_path) in msg
    _assert_names_both_ways(msg)
    assert "no hub copy" in msg
    # data.source=hub cannot help a source without a hub copy: same clear error, not a hub lookup
    with pytest.raises(DataSourceError, match="no hub copy"):
        list(iter_examples(Domain("medical", "", (MEDQUAD_A,)), DataOptions(root=str(tmp_path), source="hub")))


def test_missing_file_of_a_source_with_hub_copy(tmp_path):
    with pytest.raises(DataSourceError) as ei:
        list(iter_examples("code", DataOptions(root=str(tmp_path))))
    msg = str(ei.value)
    assert "code/HumanEval.jsonl" in msg and "data.source=hub" in msg and "openai/openai_humaneval" in msg
    _assert_names_both_ways(msg)


def test_no_data_root_at_all(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_DATA_ROOT, raising=False)
    monkeypatch.setattr(data.loading, "PROJECT_ROOT", tmp_path / "repo")  # no ../shared/data beside it
    assert default_data_root() is None
    with pytest.raises(DataSourceError) as ei:
        list(iter_examples("math"))
    msg = str(ei.value)
    assert "math/gsm8k_train.jsonl" in msg and "no data root" in msg and "data.source=hub" in msg
    _assert_names_both_ways(msg)


def test_unknown_source_mode(tmp_path):
    with pytest.raises(ValueError, match="data.source"):
        list(iter_examples("math", DataOptions(root=str(tmp_path), source="ftp")))


@pytest.mark.parametrize("content,says", [("", "the file is empty"), ("\n\n   \n", "no records")])
def test_empty_file_names_the_file(tmp_path, content, says):
    """A 0-byte file and a file of blank lines are errors naming the file, never an empty source."""
    path = tmp_path / MEDQUAD_A.file
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(Domain("medical", "", (MEDQUAD_A,)), DataOptions(root=str(tmp_path))))
    assert str(path) in str(ei.value) and says in str(ei.value)


def test_invalid_jsonl_line_names_file_and_line(tmp_path, write_jsonl, medquad_record):
    path = write_jsonl(tmp_path / MEDQUAD_A.file, [medquad_record(0), medquad_record(1)])
    with open(path, "a") as f:
        f.write("\n")  # blank lines are skipped but still counted
        f.write('{"qid": "x", "question": "unterminated\n')
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(Domain("medical", "", (MEDQUAD_A,)), DataOptions(root=str(tmp_path))))
    assert f"{path}:4:" in str(ei.value)


@pytest.mark.parametrize("line, reason", [('{"q": "unterminated', "Unterminated string, column 7"),
                                          ('{"q": "tab\there"}', "Invalid control character, column 11"),
                                          ('{"q": }', "Expecting value, column 7"), ('{"q": 1} x', "Extra data, column 10")])
def test_json_error_wording_gives_reason_and_column(tmp_path, line, reason):
    """json's messages may end in "at" ("Unterminated string starting at"): never printed as "at at column"."""
    path = tmp_path / MEDQUAD_A.file
    path.parent.mkdir(parents=True)
    path.write_text(line)
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(Domain("medical", "", (MEDQUAD_A,)), DataOptions(root=str(tmp_path))))
    msg = str(ei.value)
    assert f"{path}:1: not valid JSON ({reason})" in msg and " at," not in msg and "at at" not in msg, msg


def test_invalid_json_dict_names_file_and_line(tmp_path):
    path = tmp_path / PUBMEDQA.file
    path.parent.mkdir(parents=True)
    path.write_text('{\n  "1": {"QUESTION": "q"},\n  "2": oops\n}\n')
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(Domain("medical", "", (PUBMEDQA,)), DataOptions(root=str(tmp_path))))
    assert f"{path}:3:" in str(ei.value)
    path.write_text("[1, 2]")
    with pytest.raises(DataFormatError, match="JSON object"):
        list(iter_examples(Domain("medical", "", (PUBMEDQA,)), DataOptions(root=str(tmp_path))))


HEADER = "ID,section_header,section_text,dialogue\n"


@pytest.mark.parametrize(
    "body, line, reason",
    [
        ('0,GENHX,ok,"Doctor: hi"\n1,GENHX,"unterminated,dialogue\n2,A,b,c\n', 3, "CSV error"),
        ('0,GENHX,ok,"Doctor: hi"\n1,GENHX,"stray"quote,dialogue\n', 3, "CSV error"),
        ('0,GENHX,"two\nlines",x\n1,GENHX,ok,x\n2,GENHX,a,b,c,d\n', 5, "more fields than the header"),
    ],
    ids=["unterminated_quote", "stray_quote", "extra_fields"],
)
def test_broken_csv_names_file_and_line(tmp_path, body, line, reason):
    path = tmp_path / MTS_VALIDATION.file
    path.parent.mkdir(parents=True)
    path.write_text(HEADER + body)
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(Domain("medical", "", (MTS_VALIDATION,)), DataOptions(root=str(tmp_path))))
    assert f"{path}:{line}:" in str(ei.value) and reason in str(ei.value)


def test_csv_row_missing_a_field_names_file_line_and_field(tmp_path):
    path = tmp_path / MTS_VALIDATION.file
    path.parent.mkdir(parents=True)
    path.write_text(HEADER + "0,GENHX,ok,x\n1,GENHX,short\n")
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(Domain("medical", "", (MTS_VALIDATION,)), DataOptions(root=str(tmp_path))))
    assert f"{path}:3:" in str(ei.value) and "'dialogue' is missing" in str(ei.value)


def test_record_missing_a_field_names_file_line_and_field(tmp_path, write_jsonl, medquad_record):
    bad = medquad_record(1)
    del bad["answer"]
    path = write_jsonl(tmp_path / MEDQUAD_A.file, [medquad_record(0), bad])
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(Domain("medical", "", (MEDQUAD_A,)), DataOptions(root=str(tmp_path))))
    msg = str(ei.value)
    assert f"{path}:2:" in msg and "'answer'" in msg
    # a null value is reported as null, not as missing
    write_jsonl(path, [medquad_record(0, question=None)])
    with pytest.raises(DataFormatError, match=r":1: field 'question' is null \(not set\)"):
        list(iter_examples(Domain("medical", "", (MEDQUAD_A,)), DataOptions(root=str(tmp_path))))


def test_json_dict_record_missing_a_field_names_the_record(tmp_path):
    path = tmp_path / PUBMEDQA.file
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"123": {"QUESTION": "q?", "CONTEXTS": ["c"]}}))
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(Domain("medical", "", (PUBMEDQA,)), DataOptions(root=str(tmp_path))))
    msg = str(ei.value)
    assert str(path) in msg and "123" in msg and "'LONG_ANSWER'" in msg


def test_unknown_domain_error():
    with pytest.raises(UnknownDomainError) as ei:
        load_domain("nope")
    for name in DOMAINS:
        assert name in str(ei.value)


def test_user_domain(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"q": f"question {i}?", "a": f"answer {i}"} for i in range(4)])
    dom = user_domain("mine", path, text_field="q")
    ds = load_domain(dom, DataOptions(root=str(tmp_path / "unused")))
    assert len(ds["test"]) == 4 and len(ds["train"]) == 0
    assert sorted(ds["test"]["prompt"]) == [f"question {i}?" for i in range(4)]
    assert ds["train"].column_names == ["id", "source", "prompt", "completion", "messages"]  # empty splits keep the columns
    assert [p.id for p in eval_prompts(dom)] == ds["test"]["id"]
    paired = list(iter_examples(user_domain("mine", path, text_field="a", prompt_field="q")))
    assert paired[0][0].prompt == "User: question 0?\nAssistant:" and paired[0][0].completion == " answer 0"

    csv_path = tmp_path / "mine.csv"
    csv_path.write_text("text,other\nhello there,1\n,2\n")
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples(user_domain("csvdom", csv_path, text_field="prompt")))
    assert f"{csv_path.resolve()}:2:" in str(ei.value) and "'prompt'" in str(ei.value)


@pytest.mark.parametrize("value, says", [(5, "must be a string"), (["a", "b"], "must be a string"),
                                         ({"x": 1}, "must be a string"), (True, "must be a string")])
def test_a_user_text_field_that_holds_no_text_is_refused_naming_the_line(tmp_path, write_jsonl, value, says):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"text": "a real prompt"}, {"text": value}])
    with pytest.raises(DataFormatError, match=says) as ei:
        list(iter_examples(user_domain("mine", path, text_field="text")))
    assert f"{path.resolve()}:2:" in str(ei.value) and "'text'" in str(ei.value)


@pytest.mark.parametrize("blank", ["", "   ", "\n\t"])
def test_a_user_file_whose_every_record_is_blank_is_named_as_such(tmp_path, write_jsonl, blank):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"text": blank}] * 3)
    with pytest.raises(DataFormatError, match="all 3 of its records are blank") as ei:
        eval_prompts(user_domain("mine", path, text_field="text"))
    assert str(path.resolve()) in str(ei.value) and "test_fraction" not in str(ei.value)
    write_jsonl(path, [{"text": blank}, {"text": "one prompt"}])  # a blank record among real ones is skipped
    assert [e.prompt for e in eval_prompts(user_domain("mine", path, text_field="text"))] == ["one prompt"]


def test_user_domain_missing_file_and_bad_extension(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataSourceError) as ei:
        user_domain("mine", missing, text_field="text")
    assert str(missing) in str(ei.value) and "eval.extra_domains" in str(ei.value)
    bad = tmp_path / "prompts.xlsx"
    bad.write_text("hello\n")
    with pytest.raises(DataFormatError) as ei:
        user_domain("mine", bad, text_field="text")
    assert str(bad) in str(ei.value) and ".xlsx" in str(ei.value) and ".jsonl" in str(ei.value)


# ------------------------------------------------------------------------------------------------ tokenization
WORDS = ("the patient reported pain in the left arm after a long walk and the doctor ordered tests "
         "def return value list index for while if else print result sum of numbers is equal to").split()


@pytest.fixture(scope="module")
def tokenizer():
    import random

    from data.text import train_bpe_tokenizer

    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
                 for _ in range(400)]
    sentences += ["Café naïve Größe señor 日本語 ünïcödé."] * 5
    return train_bpe_tokenizer(sentences, vocab_size=400)


def test_train_bpe_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in ids and len(ids) == 3
    assert 256 + 3 < len(tokenizer) <= 400  # bytes + specials + learned merges
    enc = tokenizer("the patient")["input_ids"]
    assert enc[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in enc[1:]
    assert len(tokenizer("the patient reported pain")["input_ids"]) < len("the patient reported pain")  # merges


@pytest.mark.parametrize(
    "text",
    [
        "The patient reported pain in the left arm.",
        "  leading spaces,\ttabs and\nnew lines\n\n",
        "def f(x):\n    return x + 1  # code\n",
        "Café naïve Größe señor: 日本語テキスト, emoji 🙂, Ελληνικά, ½ ≤ ∞",
    ],
    ids=["ascii", "whitespace", "code", "non_ascii"],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:]) == text


def test_pack_blocks(tokenizer):
    from data.text import pack_blocks

    docs = [f"document {i}: " + " ".join(WORDS[i % 7 : i % 7 + 5 + i % 4]) for i in range(30)]
    block_size = 16
    ds = pack_blocks(docs, tokenizer, block_size)
    blocks = ds["input_ids"]
    assert ds.column_names == ["input_ids"] and blocks
    assert all(len(b) == block_size for b in blocks)
    # the blocks are the stream BOS doc EOS BOS doc EOS ..., cut into block_size pieces, tail dropped
    stream = [t for d in docs for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]]
    assert len(blocks) == len(stream) // block_size
    assert [t for b in blocks for t in b] == stream[: len(blocks) * block_size]
    flat = [t for b in blocks for t in b]
    for i, t in enumerate(flat[:-1]):
        if t == tokenizer.eos_token_id:
            assert flat[i + 1] == tokenizer.bos_token_id  # every document boundary is EOS then BOS
    # a datasets.Dataset with a text column gives the same blocks
    import datasets

    assert pack_blocks(datasets.Dataset.from_dict({"text": docs}), tokenizer, block_size)["input_ids"] == blocks
    # packing per batch of documents still gives full blocks only
    assert all(len(b) == block_size for b in pack_blocks(docs, tokenizer, block_size, batch_size=4)["input_ids"])


def test_cached_pack_blocks(tokenizer, monkeypatch, tmp_path):
    from data.text import cache_root, cached_pack_blocks

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    docs = [f"cached document number {i} with the patient" for i in range(40)]
    calls = []

    def texts_fn():
        calls.append(1)
        return docs

    first = cached_pack_blocks(["fp-1", "train"], texts_fn, tokenizer, 12)
    second = cached_pack_blocks(["fp-1", "train"], texts_fn, tokenizer, 12)
    assert len(calls) == 1  # the second call is a cache hit
    assert first["input_ids"] == second["input_ids"] and len(first) > 0
    assert all(len(b) == 12 for b in first["input_ids"])
    entries = list((tmp_path / "blocks").iterdir())
    assert len(entries) == 1 and not any(p.name.startswith(".tmp-") for p in entries)
    # a different key or block size is a different entry
    cached_pack_blocks(["fp-2", "train"], texts_fn, tokenizer, 12)
    cached_pack_blocks(["fp-1", "train"], texts_fn, tokenizer, 8)
    assert len(calls) == 3
    names = [p.name for p in (tmp_path / "blocks").iterdir()]
    assert len(names) == 3 and not any(n.startswith(".tmp-") for n in names)


def test_damaged_block_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    """A truncated cache file (a killed writer, a full disk) is detected and rebuilt, never read as data."""
    import glob

    from data.text import cache_root, cached_pack_blocks, train_bpe_tokenizer

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    tok = train_bpe_tokenizer(iter(["hello world this is text"] * 50), 300, min_frequency=1)
    texts = lambda: [f"hello world this is text number {i}" for i in range(200)]  # noqa: E731
    ds = cached_pack_blocks(["k"], texts, tok, 16)
    first = [list(map(int, row)) for row in ds["input_ids"]]  # plain Python copy: the file is damaged below
    del ds
    (arrow,) = glob.glob(str(cache_root() / "blocks" / "*" / "*.arrow"))
    data = open(arrow, "rb").read()
    os.unlink(arrow)  # a new file (never truncate a file some process may still have mapped)
    with open(arrow, "wb") as f:
        f.write(data[: len(data) // 2])
    again = [list(map(int, row)) for row in cached_pack_blocks(["k"], texts, tok, 16)["input_ids"]]
    assert again == first


def test_non_utf8_data_file_names_the_file(tmp_path):
    from core.errors import DataFormatError
    from data.loading import eval_prompts, user_domain

    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataFormatError) as ei:
        eval_prompts(user_domain("bad", f, "text"))
    assert str(f) in str(ei.value) and "UTF-8" in str(ei.value)


def test_a_plain_text_file_that_is_not_utf8_is_refused_naming_it(tmp_path):
    """Binary bytes in a corpus .txt file are an error naming the file, not text with replacement characters."""
    from core.errors import DataFormatError
    from data.loading import _records_from_file
    from data.registry import DOMAINS

    source = next(s for s in DOMAINS["corpus"].sources)
    bad = tmp_path / "book.txt"
    bad.write_bytes(b"Chapter 1\n\n" + bytes(range(128, 256)) * 4)
    with pytest.raises(DataFormatError, match=f"{bad}: not valid UTF-8"):
        list(_records_from_file(source, bad))
