"""File readers with precise errors: every parse failure names the file and the line (or row)."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterator

from .errors import DataFormatError

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
    with open(path, encoding="utf-8-sig", errors="replace") as f:
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
