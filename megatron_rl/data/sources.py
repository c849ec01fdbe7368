"""Reading prompt rows from JSONL or Parquet, each row tagged with where it came from.

The location (``file:line`` for JSONL, ``file row N`` for Parquet) travels with the row
so that a malformed row can be reported precisely by whoever validates it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


class DatasetFormatError(ValueError):
    """A dataset file that cannot be used as given; the message lists every bad row."""


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            location = f"{path}:{number}"
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as exc:
                yield location, exc


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):  # streamed: a check reads only the first rows
        for row in batch.to_pylist():
            yield f"{path} row {index}", row
            index += 1


def read_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """``(location, row)`` per record; a JSONL line that is not JSON yields its decode error."""
    path = Path(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DatasetFormatError(f"{path}: unknown dataset format {path.suffix!r}; allowed: {sorted(SUFFIXES)}")
    if not path.is_file():
        raise DatasetFormatError(f"{path}: no such dataset file")
    return _jsonl_rows(path) if kind == "jsonl" else _parquet_rows(path)


Parsed = TypeVar("Parsed")


def read_parsed(
    path: str | Path, parse: Callable[[str, Any], Parsed], noun: str, form: str, limit: Optional[int] = None
) -> list[Parsed]:
    """Every row of ``path`` through ``parse(location, row)`` (the first ``limit`` rows when
    given); one DatasetFormatError, one line, for a file with bad rows (how many, and the
    first with its location) or none at all. ``noun``, ``form``: what a row is and holds,
    for the errors."""
    items, problems = [], []
    for n, (location, row) in enumerate(read_rows(path)):
        if limit is not None and n >= limit:
            break
        try:
            items.append(parse(location, row))
        except DatasetFormatError as err:
            problems.append(err)
    if problems:
        raise DatasetFormatError(f"{len(problems)} malformed {noun} row(s); the first: {problems[0]}")
    if not items:
        raise DatasetFormatError(f"{path}: holds no {noun}s; a row holds {form}")
    return items
