"""specdraft.json's schema: what is written is what is read, a wrong type is a clear error, unknown fields survive."""
from __future__ import annotations

import json
import typing
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st

from models.checkpoints import CheckpointError, read_specdraft_meta
from models.checkpoints import save_hf_atomic
from models.checkpoints import SpecdraftMeta, as_meta
from core.errors import SpecdraftMetaError

KNOWN = {f.name: f for f in fields(SpecdraftMeta) if f.name not in ("extra", "present")}
HINTS = typing.get_type_hints(SpecdraftMeta)
_text = st.text(min_size=0, max_size=8)
_json = st.recursive(st.none() | st.booleans() | st.integers(-9, 9) | _text,
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3), max_leaves=6)


def _value(name: str):
    """A value of the field's declared type (or null)."""
    hint = str(HINTS[name])
    opts = [st.none()]
    if "dict" in hint:
        opts.append(st.dictionaries(_text, _json, max_size=3))
    if "list" in hint:
        opts.append(st.lists(_json, max_size=3))
    if "bool" in hint:
        opts.append(st.booleans())
    elif "float" in hint:
        opts.append(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-99, 99))
    elif "int" in hint:
        opts.append(st.integers(0, 10**9))
    if "str" in hint:
        opts.append(_text)
    return st.one_of(*opts)


_docs = st.lists(st.sampled_from(sorted(KNOWN)), unique=True, max_size=12).flatmap(
    lambda names: st.fixed_dictionaries({n: _value(n) for n in names})).flatmap(
    lambda known: st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k not in KNOWN), _json,
                                  max_size=3).map(lambda extra: {**known, **extra}))


@given(_docs)
def test_what_is_written_is_what_is_read(doc):
    """Any document of typed known fields and unknown extras: the file holds the same JSON object (null fields
    kept, unknown fields kept), and reading it gives the same values through the attributes."""
    meta = SpecdraftMeta.from_dict(doc)
    again = json.loads(json.dumps(meta.to_dict()))
    assert again == json.loads(json.dumps(doc))
    for k, v in doc.items():
        assert (getattr(meta, k) if k in KNOWN else meta.extra[k]) == v


@pytest.mark.parametrize("field,bad", [("selected_step", "12"), ("train", [1, 2]), ("kind", 3), ("distilled", "yes"),
                                       ("validation_loss_nats_per_token", "low"), ("layers", {"a": 1})])
def test_a_field_of_the_wrong_type_names_the_file_and_the_field(tmp_path, field, bad):
    (tmp_path / "specdraft.json").write_text(json.dumps({"kind": "distilled", field: bad}))
    with pytest.raises(CheckpointError, match=rf"specdraft.json: field '{field}' must be .*got"):
        read_specdraft_meta(tmp_path)


def test_not_json_or_not_an_object_is_a_checkpoint_error_and_no_file_is_empty(tmp_path):
    assert not read_specdraft_meta(tmp_path) and read_specdraft_meta(tmp_path).kind is None
    (tmp_path / "specdraft.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_specdraft_meta(tmp_path)
    (tmp_path / "specdraft.json").write_text("[1, 2]")
    with pytest.raises(SpecdraftMetaError, match="must hold a JSON object"):
        read_specdraft_meta(tmp_path)


def test_a_writer_with_a_wrong_type_writes_nothing(tmp_path):
    """The schema is checked before the checkpoint folder is created: nothing half-written is left behind."""
    from tinymodels import tiny_llama

    with pytest.raises(SpecdraftMetaError, match="draft_parameters"):
        save_hf_atomic(tiny_llama(), None, tmp_path / "d", extra={"kind": "distilled", "draft_parameters": "many"})
    assert not (tmp_path / "d").exists() and not list(tmp_path.iterdir())


def test_derived_facts():
    m = as_meta({"kind": "distilled", "teacher_data": {"time_s": 2.5}, "teacher_cache": {"time_s": 1},
                 "train": {"steps": 7}})
    assert m.one_off_pass_seconds == 3.5 and m.init_kind == "config" and m.is_distilled is True
    # a pass that reused stored shards costs what computing them took, not its short wall clock
    reused = as_meta({"kind": "distilled", "teacher_cache": {"time_s": 0.2, "cost_s": 40.0}})
    assert reused.one_off_pass_seconds == 40.0
    assert m.steps_trained == 7 and m.quantize_mode == "none" and not m.trained_here
    base = as_meta({"kind": "baseline", "distilled": False, "quantize": "int8"})
    assert base.is_distilled is False and base.quantize_mode == "int8" and base.one_off_pass_seconds == 0
    assert as_meta({"kind": "lora"}).is_distilled is None and as_meta(None).init_kind is None
