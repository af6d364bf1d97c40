"""The domain registry: which files make up each domain and how a record becomes (prompt, completion).

A *domain* (``medical``, ``code``, ...) is a list of *sources*. A source is one file under the data root (and,
where one exists, the ``datasets`` hub id that holds the same data), a reader format, a formatter that turns one
record into an :class:`Example`, and a split policy (see :mod:`data.loading`).

To add a domain without Python, declare it in YAML (:mod:`data.loading`: ``conf/domain/<name>.yaml`` or
``data.declared_domains``); built-in ones are :class:`Domain` s in :data:`DOMAINS`.

File readers with precise errors: every parse failure names the file and the line (or row).
"""
from __future__ import annotations

import ast
import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from core.errors import DataFormatError

csv.field_size_limit(1 << 28)
_SHORT_ROW = object()  # csv.DictReader's filler for the fields a short row does not have


def _json_reason(e: json.JSONDecodeError) -> str:
    """The parser's reason and column, e.g. ``Expecting value, column 7``. Some of json's messages end in "at"
    ("Unterminated string starting at"), so the column is never appended with another "at"."""
    return f"{e.msg.removesuffix(' starting at').removesuffix(' at')}, column {e.colno}"


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, value)`` for each non-blank line (1-based line numbers).

    Raises:
        DataFormatError: a line is not valid JSON (message gives file, line and the parser's reason).
    """
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(
                    f"{path}:{lineno}: not valid JSON ({_json_reason(e)}). Each line of a .jsonl file must be one "
                    f"JSON value; fix or remove that line."
                ) from None


def read_json_dict(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(key, value)`` of a JSON object file (e.g. PubMedQA's ``{pmid: record}``).

    Raises:
        DataFormatError: invalid JSON (with line) or the top level is not an object.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}:{e.lineno}: not valid JSON ({_json_reason(e)}); fix the file or replace it "
                              f"with the published one.") from None
    if not isinstance(obj, dict):
        raise DataFormatError(f"{path}: expected a JSON object mapping ids to records, got {type(obj).__name__}.")
    yield from obj.items()


def read_csv(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line_number, row_dict)`` for each CSV row (line of the row's start, header is line 1).

    Raises:
        DataFormatError: an empty file, a row with more fields than the header, or a CSV syntax error.
    """
    with open(path, encoding="utf-8-sig", newline="") as f:
        # strict: broken quoting (a stray or unterminated quote) is an error, not silently merged into one field
        reader = csv.DictReader(f, strict=True, restval=_SHORT_ROW)
        start = 1
        try:
            if not reader.fieldnames:
                raise DataFormatError(f"{path}: empty CSV file (no header row).")
            start = reader.line_num + 1
            for row in reader:
                if None in row:
                    raise DataFormatError(
                        f"{path}:{start}: row has more fields than the header ({len(reader.fieldnames)} columns); "
                        f"quote fields that contain commas."
                    )
                # a short row lacks its last fields (reported as missing, not as null, when a field is read)
                yield start, {k: v for k, v in row.items() if v is not _SHORT_ROW}
                start = reader.line_num + 1
        except csv.Error as e:
            # csv's line_num lags on a failing row; report the line where the failing row starts
            raise DataFormatError(f"{path}:{start}: CSV error: {e}") from None


def read_text(path: Path) -> Iterator[tuple[int, str]]:
    """Yield ``(paragraph_index, paragraph)`` of a plain text file, paragraphs split on blank lines."""
    with open(path, encoding="utf-8-sig") as f:  # bad bytes: UnicodeDecodeError, named by the caller
        text = f.read().replace("\r\n", "\n")
    for i, para in enumerate(p for p in text.split("\n\n") if p.strip()):
        yield i, para.strip("\n")


def read_json_records(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(record_number, record)`` (1-based) of a JSON file holding an array of records (or an object with
    one array-valued key, e.g. ``{"data": [...]}``).

    Raises:
        DataFormatError: invalid JSON (with line and column) or no array of records at the top level.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}:{e.lineno}: not valid JSON ({_json_reason(e)}); fix the file.") from None
    if isinstance(obj, dict):
        lists = [v for v in obj.values() if isinstance(v, list)]
        if len(lists) == 1:
            obj = lists[0]
    if not isinstance(obj, list):
        raise DataFormatError(f"{path}: expected a JSON array of records (or an object with one array), got "
                              f"{type(obj).__name__}; use format jsonl for one record per line.")
    yield from enumerate(obj, 1)


def read_parquet(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield ``(row_number, row)`` (1-based) of a Parquet file, read with ``datasets``.

    Raises:
        DataFormatError: the file is not Parquet (the message names it).
    """
    import datasets

    try:
        ds = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors: not parquet, truncated, ...
        raise DataFormatError(f"{path}: not a readable Parquet file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); re-export it as Parquet or declare "
                              f"its real format.") from None
    yield from enumerate(ds, 1)


def read_disk(path: Path, split: str = "train") -> Iterator[tuple[int, dict]]:
    """Yield ``(row_number, row)`` of a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or split
    ``split`` of a ``DatasetDict``).

    Raises:
        DataFormatError: not a ``save_to_disk`` folder, or the DatasetDict has no split ``split``.
    """
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001
        raise DataFormatError(f"{path}: not a datasets save_to_disk folder ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); write it with Dataset.save_to_disk "
                              f"or declare its real format.") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataFormatError(f"{path}: the saved DatasetDict has splits {sorted(ds)}, not {split!r}; set "
                                  f"disk_split to one of them.")
        ds = ds[split]
    yield from enumerate(ds, 1)


READERS = {"jsonl": read_jsonl, "json_dict": read_json_dict, "json_records": read_json_records, "csv": read_csv,
           "text": read_text, "parquet": read_parquet}


def reader(name: str):
    """The reader of format ``name`` (``disk:<split>`` reads that split of a saved DatasetDict)."""
    if name.startswith("disk:"):
        split = name.split(":", 1)[1]
        return lambda path: read_disk(path, split)
    return READERS[name]


@dataclass(frozen=True)
class Example:
    """One formatted record. ``prompt`` is what a user would send; ``completion`` the reference continuation.

    Training text is ``prompt + completion``; evaluation prompts are the ``prompt`` of test records.
    """

    id: str
    prompt: str
    completion: str
    # the conversation behind a chat-shaped record: ((role, content), ...) ending with the assistant turn that is
    # ``completion`` (or with a user turn: a prompt without a reference answer); None for raw text / completion-style
    # prompts (code, QA, corpus). With it, :mod:`data.text` renders prompt and completion in the target's chat
    # template; ``prompt`` / ``completion`` hold the plain rendering (:func:`data.text.plain_render`).
    messages: tuple[tuple[str, str], ...] | None = None

    @property
    def text(self) -> str:
        return self.prompt + self.completion


@dataclass(frozen=True)
class HubSource:
    """The same data on the Hugging Face hub: ``datasets.load_dataset(path, name, split=split)``.

    ``to_local`` maps a hub row to the local file's record schema so one formatter serves both.
    """

    path: str
    name: str | None = None
    split: str = "train"
    to_local: Callable[[dict], Any] | None = None


Formatter = Callable[[Any, Callable[[str], Any]], "tuple[str, str] | None"]


@dataclass(frozen=True)
class Source:
    """One data file of a domain.

    Attributes:
        name: stable short name; part of every record's split key, so never rename it.
        file: path relative to the data root.
        format: reader name in :data:`data.registry.READERS` (``jsonl``, ``json_dict``, ``json_records``, ``csv``,
            ``text``, ``parquet``, ``disk:<split>``) or ``hub`` (a hub-only source, read with ``data.source=hub``).
        format_record: ``(record, get) -> (prompt, completion)`` or ``(prompt, completion, messages)`` (a chat
            record, see :attr:`Example.messages`) or ``None`` to skip; ``get(field)`` fetches a
            required field and raises a :class:`DataFormatError` naming file, line and field when it is absent.
        record_id: field that identifies a record (``None``: the line number / key).
        split_policy: ``hash`` | ``train`` | ``validation`` | ``test`` (see :func:`data.loading.assign_split`).
        hub: where the same data lives on the hub, if anywhere.
        license: the record-level license, repeated in reports that quote the data.
        declaration: for a domain declared in YAML, its file settings (shape, fields, ...): a changed declaration
            changes :func:`data.loading.files_fingerprint`, so no cache serves text formatted the old way.
    """

    name: str
    file: str
    format: str
    format_record: Formatter
    record_id: str | None = None
    split_policy: str = "hash"
    hub: HubSource | None = None
    license: str = ""
    declaration: str = ""  # a declared source's settings (JSON), part of its data fingerprint (data/loading.py)


@dataclass(frozen=True)
class Domain:
    name: str
    description: str
    sources: tuple[Source, ...]
    tags: tuple[str, ...] = field(default_factory=tuple)


def _clean(s: Any) -> str:
    """Collapse runs of spaces/tabs and trim; keep newlines (they carry structure in code and dialogue).

    Raises:
        DataFormatError: a JSON object or list where text belongs (the caller names the file and line)."""
    if isinstance(s, (dict, list, tuple)):
        raise DataFormatError(f"a text field holds a JSON {'object' if isinstance(s, dict) else 'list'}, not text; "
                              f"fix the record or replace the file with the published one")
    s = str(s).replace("\r\n", "\n")
    s = re.sub(r"[ \t]+", " ", s)
    s = re.sub(r"\n\s*\n\s*\n+", "\n\n", s)
    return s.strip()


def qa(question: str, answer: str | None) -> tuple[str, str]:
    return f"Question: {_clean(question)}\nAnswer:", (" " + _clean(answer)) if answer else ""


def chat(user: str, assistant: str | None) -> tuple[str, str, tuple]:
    """A single-turn chat record: ``("User: <user>\nAssistant:", " <assistant>", messages)`` (the plain rendering,
    :func:`data.text.plain_render`, and the conversation the target's chat template renders)."""
    u = _clean(user)
    a = _clean(assistant) if assistant else None
    messages = (("user", u),) + ((("assistant", a),) if a is not None else ())
    return f"User: {u}\nAssistant:", (" " + a) if a is not None else "", messages


# ----------------------------------------------------------------------------------------------- medical
def _pubmedqa(r, get):
    contexts = " ".join(_clean(c) for c in get("CONTEXTS"))
    return f"Context: {contexts}\nQuestion: {_clean(get('QUESTION'))}\nAnswer:", " " + _clean(get("LONG_ANSWER"))


def _medquad(r, get):
    return qa(get("question"), get("answer"))


def _meqsum(r, get):
    return f"Summarize the patient question.\n{_clean(get('CHQ'))}\nSummary:", " " + _clean(get("Summary"))


def _mtsdialog(r, get):
    return (
        f"Dialogue:\n{_clean(get('dialogue'))}\nWrite the {_clean(get('section_header'))} section of the note.\nNote:",
        " " + _clean(get("section_text")),
    )


# MTS-Dialog's section headers, as a clinician names the note's sections
_MTS_SECTIONS = {
    "FAM/SOCHX": "family and social history", "GENHX": "history of present illness",
    "PASTMEDICALHX": "past medical history", "CC": "chief complaint", "PASTSURGICAL": "past surgical history",
    "ALLERGY": "allergies", "ROS": "review of systems", "MEDICATIONS": "medications", "ASSESSMENT": "assessment",
    "EXAM": "physical examination", "DIAGNOSIS": "diagnosis", "DISPOSITION": "disposition", "PLAN": "plan",
    "EDCOURSE": "emergency department course", "IMMUNIZATIONS": "immunizations", "IMAGING": "imaging",
    "GYNHX": "gynecologic history", "PROCEDURES": "procedures", "OTHER_HISTORY": "other history", "LABS": "labs",
}


def _clinical_note(r, get):
    header = _clean(get("section_header"))
    section = _MTS_SECTIONS.get(header.upper(), header.lower())
    return chat(f"Here is a conversation between a doctor and a patient.\n\n{_clean(get('dialogue'))}\n\n"
                f"Write the {section} section of the clinical note for this visit.", _clean(get("section_text")))


def _medmcqa(r, get):
    options = get("options")
    if isinstance(options, str):
        options = ast.literal_eval(options)
    opts = "\n".join(f"{k}. {_clean(v)}" for k, v in options.items())
    return f"Question: {_clean(get('question'))}\n{opts}\nAnswer:", f" {get('answer_idx')}. {_clean(get('answer'))}"


def _pubmedqa_from_hub(row: dict) -> dict:
    return {"QUESTION": row["question"], "CONTEXTS": row["context"]["contexts"], "LONG_ANSWER": row["long_answer"]}


# ----------------------------------------------------------------------------------------------- code
def _humaneval(r, get):
    return get("prompt"), get("canonical_solution")


def _mbpp(r, get):
    tests = "\n".join(r.get("test_list") or [])
    return f'"""\n{_clean(get("text"))}\n{tests}\n"""\n', get("code").replace("\r\n", "\n")


# ----------------------------------------------------------------------------------------------- chat
def _turns(r, get):
    return chat(get("turns")[0], None)


def _oasst_tree(r, get):
    root = get("prompt")
    replies = sorted(root.get("replies") or [], key=lambda x: (x.get("rank") is None, x.get("rank") or 0))
    return chat(root["text"], replies[0]["text"] if replies else None)


def _prompt_string(r, get):
    if not isinstance(r, str):
        raise DataFormatError("expected each line to be a JSON string (a prompt)")
    return chat(r, None)


def _selfinstruct(r, get):
    inst = get("instances")[0] if get("instances") else {}
    user = get("instruction") + (("\n" + inst["input"]) if inst.get("input") else "")
    return chat(user, inst.get("output"))


# ----------------------------------------------------------------------------------------------- math
def _gsm8k(r, get):
    return qa(get("question"), get("answer"))


# ----------------------------------------------------------------------------------------------- corpus
def _paragraph(r, get):
    return "", _clean(r)


_MEDQUAD = [
    ("medquad_cancergov", "medquad_1_CancerGov_QA.jsonl"),
    ("medquad_mplus", "medquad_4_MPlus_Health_Topics_QA.jsonl"),
    ("medquad_niddk", "medquad_5_NIDDK_QA.jsonl"),
    ("medquad_ninds", "medquad_6_NINDS_QA.jsonl"),
    ("medquad_seniorhealth", "medquad_7_SeniorHealth_QA.jsonl"),
    ("medquad_nhlbi", "medquad_8_NHLBI_QA_XML.jsonl"),
    ("medquad_cdc", "medquad_9_CDC_QA.jsonl"),
]

MEDICAL = Domain(
    "medical",
    "PubMedQA, MedQuAD, MeQSum, MTS-Dialog, MedMCQA: biomedical QA, consumer health questions, clinical notes",
    (
        Source("pubmedqa", "medical/pubmedqa_ori_pqal.json", "json_dict", _pubmedqa,
               hub=HubSource("qiaojin/PubMedQA", "pqa_labeled", "train", _pubmedqa_from_hub), license="MIT"),
        *(Source(n, f"medical/{f}", "jsonl", _medquad, record_id="qid", license="CC-BY-4.0") for n, f in _MEDQUAD),
        Source("meqsum", "medical/meqsum.jsonl", "jsonl", _meqsum, record_id="File", license="CC-BY-4.0"),
        Source("mtsdialog_train", "medical/mtsdialog_MTS-Dialog-TrainingSet.csv", "csv", _mtsdialog,
               record_id="ID", split_policy="train", license="CC-BY-4.0"),
        Source("mtsdialog_validation", "medical/mtsdialog_MTS-Dialog-ValidationSet.csv", "csv", _mtsdialog,
               record_id="ID", split_policy="test", license="CC-BY-4.0"),
        Source("medmcqa", "medical/medmcqa_dev_singleanswer.jsonl", "jsonl", _medmcqa, record_id="realidx",
               license="MIT"),
    ),
)

CLINICAL_NOTES = Domain(
    "clinical_notes",
    "MTS-Dialog: a doctor-patient conversation -> one section of its clinical note (chat; the note restates the "
    "conversation, so drafts that copy from the prompt are accepted often)",
    (
        Source("mtsdialog_train", "medical/mtsdialog_MTS-Dialog-TrainingSet.csv", "csv", _clinical_note,
               record_id="ID", split_policy="train", license="CC-BY-4.0"),
        Source("mtsdialog_validation", "medical/mtsdialog_MTS-Dialog-ValidationSet.csv", "csv", _clinical_note,
               record_id="ID", split_policy="test", license="CC-BY-4.0"),
    ),
)

CODE = Domain(
    "code",
    "HumanEval, HumanEval-X (C++, Java, JS), MBPP: function completion from a docstring or a description",
    (
        Source("humaneval", "code/HumanEval.jsonl", "jsonl", _humaneval, record_id="task_id", split_policy="test",
               hub=HubSource("openai/openai_humaneval", None, "test"), license="MIT"),
        Source("humanevalx_cpp", "code/humanevalx_cpp.jsonl", "jsonl", _humaneval, record_id="task_id",
               split_policy="test", license="Apache-2.0"),
        Source("humanevalx_java", "code/humanevalx_java.jsonl", "jsonl", _humaneval, record_id="task_id",
               split_policy="test", license="Apache-2.0"),
        Source("humanevalx_js", "code/humanevalx_js.jsonl", "jsonl", _humaneval, record_id="task_id",
               split_policy="test", license="Apache-2.0"),
        Source("mbpp", "code/mbpp.jsonl", "jsonl", _mbpp, record_id="task_id",
               hub=HubSource("google-research-datasets/mbpp", "full", "train"), license="CC-BY-4.0"),
    ),
)

CHAT = Domain(
    "chat",
    "MT-Bench and Vicuna-bench first turns (eval only), OASST conversations, OASST prompts, Self-Instruct seeds",
    (
        Source("mt_bench", "chat/mt_bench_question.jsonl", "jsonl", _turns, record_id="question_id",
               split_policy="test", license="Apache-2.0"),
        Source("vicuna_bench", "chat/vicuna_bench_question.jsonl", "jsonl", _turns, record_id="question_id",
               split_policy="test", license="Apache-2.0"),
        Source("oasst_trees", "chat/oasst_en_100_trees.jsonl", "jsonl", _oasst_tree, record_id="message_tree_id",
               license="Apache-2.0"),
        Source("oasst_prompts", "chat/oasst_prompt_lottery_en_250.jsonl", "jsonl", _prompt_string,
               split_policy="test", license="Apache-2.0"),
        Source("selfinstruct", "chat/selfinstruct_seed_tasks.jsonl", "jsonl", _selfinstruct, record_id="id",
               license="Apache-2.0"),
    ),
)

MATH = Domain(
    "math",
    "GSM8K grade-school math word problems with worked solutions",
    (
        Source("gsm8k_train", "math/gsm8k_train.jsonl", "jsonl", _gsm8k, split_policy="train",
               hub=HubSource("openai/gsm8k", "main", "train"), license="MIT"),
        Source("gsm8k_test", "math/gsm8k_test.jsonl", "jsonl", _gsm8k, split_policy="test",
               hub=HubSource("openai/gsm8k", "main", "test"), license="MIT"),
    ),
)

_CORPUS_FILES = [
    "gutenberg_1342_pride_and_prejudice.txt", "gutenberg_1661_adventures_of_sherlock_holmes.txt",
    "gutenberg_74_tom_sawyer.txt", "gutenberg_84_frankenstein.txt", "gutenberg_nltk_austen-emma.txt",
    "gutenberg_nltk_austen-persuasion.txt", "gutenberg_nltk_austen-sense.txt", "gutenberg_nltk_blake-poems.txt",
    "gutenberg_nltk_bryant-stories.txt", "gutenberg_nltk_burgess-busterbrown.txt", "gutenberg_nltk_carroll-alice.txt",
    "gutenberg_nltk_chesterton-ball.txt", "gutenberg_nltk_chesterton-brown.txt",
    "gutenberg_nltk_chesterton-thursday.txt", "gutenberg_nltk_edgeworth-parents.txt",
    "gutenberg_nltk_melville-moby_dick.txt", "gutenberg_nltk_milton-paradise.txt",
    "gutenberg_nltk_shakespeare-caesar.txt", "gutenberg_nltk_shakespeare-hamlet.txt",
    "gutenberg_nltk_shakespeare-macbeth.txt", "gutenberg_nltk_whitman-leaves.txt", "tinyshakespeare_input.txt",
    "wikitext2_tokenized_valid.txt", "wikitext2_tokenized_test.txt",
]

CORPUS = Domain(
    "corpus",
    "Public-domain books and WikiText-2: general English text for pretraining the reference target",
    tuple(
        Source(f.removesuffix(".txt"), f"corpus/{f}", "text", _paragraph, license="public domain / CC-BY-SA-3.0")
        for f in _CORPUS_FILES
    ),
    tags=("pretraining",),
)

# ----------------------------------------------------------------------------------------------- summarization
def _scitldr(r, get):
    abstract = " ".join(_clean(s) for s in get("source"))
    targets = get("target")
    return chat(f"Write a one-sentence TL;DR of this paper abstract.\n{abstract}", targets[0] if targets else None)


SUMMARIZATION = Domain(
    "summarization",
    "SciTLDR-A (dev): a paper abstract's sentences -> its one-sentence TL;DR",
    (Source("scitldr_a_dev", "summarization/scitldr_A_dev.jsonl", "jsonl", _scitldr, record_id="paper_id",
            license="Apache-2.0"),),
)


# ----------------------------------------------------------------------------------------------- translation
# NTREX-128 is one sentence per line in parallel files: line i of src.eng.txt translates to line i of ref.<lang>.txt.
# A source's file is the reference file; this reader pairs each of its lines with the same line of the English file.
_NTREX_SRC = "ntrex128_newstest2019-src.eng.txt"
_NTREX_LANGS = (("deu", "German"), ("fra", "French"), ("spa", "Spanish"))


def _read_ntrex_pair(path):
    """Yield ``(line_number, {"src", "ref", "lang"})`` pairing ``path`` (ref.<lang>) with the English source file.

    Raises:
        DataFormatError: the English file is missing or the two files differ in line count.
    """
    from pathlib import Path

    path = Path(path)
    src_path = path.with_name(_NTREX_SRC)
    if not src_path.exists():
        raise DataFormatError(f"{path}: its English source {src_path} is missing; NTREX needs both files.")

    def lines(p):
        with open(p, encoding="utf-8-sig") as f:
            return f.read().replace("\r\n", "\n").rstrip("\n").split("\n")

    src, ref = lines(src_path), lines(path)
    if len(src) != len(ref):
        raise DataFormatError(f"{path}: {len(ref)} lines but {src_path} has {len(src)}; the files must be parallel.")
    lang = path.name.split("-ref.")[-1].split(".")[0]
    for i, (a, b) in enumerate(zip(src, ref), 1):
        yield i, {"src": a, "ref": b, "lang": lang}


def _register_reader(name, fn):

    READERS.setdefault(name, fn)


_register_reader("ntrex_pair", _read_ntrex_pair)


def _ntrex(r, get):
    if not get("src").strip():
        return None
    lang = dict(_NTREX_LANGS)[get("lang")]
    return chat(f"Translate English to {lang}: {_clean(get('src'))}", get("ref"))


TRANSLATION = Domain(
    "translation",
    "NTREX-128 newstest2019: English news sentences -> German, French, Spanish (line i of src with line i of ref)",
    tuple(
        Source(f"ntrex_{code}", f"translation/ntrex128_newstest2019-ref.{code}.txt", "ntrex_pair", _ntrex,
               license="CC-BY-SA-4.0")
        for code, _ in _NTREX_LANGS
    ),
)


# ----------------------------------------------------------------------------------------------- Spec-Bench
# Spec-Bench (Xia et al. 2024): 480 prompts in 6 task categories; each category is its own test-only domain.
# The multi-turn conversation category is MT-Bench's 8 categories. The prompt is the first user turn, formatted
# like the chat domain.
SPECBENCH_CATEGORIES: dict[str, tuple[str, ...]] = {
    "specbench_mt_bench": ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"),
    "specbench_translation": ("translation",),
    "specbench_summarization": ("summarization",),
    "specbench_qa": ("qa",),
    "specbench_math_reasoning": ("math_reasoning",),
    "specbench_rag": ("rag",),
}


def _specbench(categories):
    def fmt(r, get):
        if get("category") not in categories:
            return None
        ref = r.get("reference") or []
        first = ref[0] if ref else None  # rag: a list of the answer's parts
        return chat(get("turns")[0], ", ".join(map(str, first)) if isinstance(first, list) else first)

    return fmt


SPECBENCH = tuple(
    Domain(
        name,
        f"Spec-Bench {', '.join(cats)} (first turn; test only; items from "
        + {"specbench_mt_bench": "MT-Bench", "specbench_translation": "WMT14 de-en",
           "specbench_summarization": "CNN/DailyMail", "specbench_qa": "Natural Questions",
           "specbench_math_reasoning": "GSM8K", "specbench_rag": "DPR / Natural Questions"}[name] + ")",
        (Source("spec_bench", "specbench/spec_bench_question.jsonl", "jsonl", _specbench(cats),
                record_id="question_id", split_policy="test", license="Apache-2.0"),),
        tags=("specbench",),
    )
    for name, cats in SPECBENCH_CATEGORIES.items()
)

DOMAINS: dict[str, Domain] = {
    d.name: d for d in (MEDICAL, CLINICAL_NOTES, CODE, CHAT, MATH, CORPUS, SUMMARIZATION, TRANSLATION, *SPECBENCH)
}


_REPORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def usable_name(name) -> bool:
    """Whether ``name`` follows :func:`check_report_name`'s rule."""
    return isinstance(name, str) and _REPORT_NAME.fullmatch(name) is not None


def check_report_name(name, key: str) -> str:
    """A domain or draft name that appears in report tables, file names (plots, per-prompt rows) and routing
    tables: letters, digits and ``_ . + -``, starting with a letter or digit.

    Raises:
        ValueError: naming ``key``, the bad name and the rule (e.g. ``a|b`` would split a Markdown table column).
    """
    if not usable_name(name):
        raise ValueError(f"{key}: {name!r} is not a usable name: it appears in report tables, plot file names and "
                         f"routing.json, so use letters, digits and _ . + - (starting with a letter or digit), "
                         f"e.g. {re.sub(r'[^A-Za-z0-9_.+-]+', '_', str(name)).strip('_.+-') or 'my_domain'!r}.")
    return name
