"""Records from a local .jsonl / .json / .parquet file or a hub data set, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """Data that is missing, empty or malformed; the message names where it came from."""


def is_local(source: str) -> bool:
    """A local file (by suffix or existence) rather than a hub data set name."""
    return Path(source).suffix in LOCAL_SUFFIXES or Path(source).expanduser().exists()


def read_records(source: str, split: str = "train", subset: str | None = None, what: str = "data") -> list[dict]:
    """Every record of `source` (at least one); `what` names the config key in error messages."""
    records = _read(source, split, subset, what)
    if not records:
        raise DataError(f"{what}: {source} has no records")
    return records


def _read(source: str, split: str, subset: str | None, what: str) -> list[dict]:
    if is_local(source):
        return _read_file(Path(source).expanduser(), what)
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what}: {source!r} is not a file, and the `datasets` package that would load it from "
                        "the hub is not installed") from None
    try:
        return list(datasets.load_dataset(source, subset, split=split))
    except Exception as error:  # noqa: BLE001 - hub, network and format errors alike
        raise DataError(f"{what}: could not load data set {source!r} split {split!r}: {error}") from None


def _read_file(file: Path, what: str) -> list[dict[str, Any]]:
    if not file.is_file():
        raise DataError(f"{what}: no such file {file}")
    if file.suffix == ".parquet":
        import pandas as pd

        try:
            frame = pd.read_parquet(file)
        except Exception as error:  # noqa: BLE001 - pyarrow raises many kinds
            raise DataError(f"{what}: {file} is not a readable parquet file ({error})") from None
        # a column missing from some records reads as NaN: make it absent, not the value "nan"
        return [{k: v for k, v in record.items() if not (isinstance(v, float) and v != v)}
                for record in frame.to_dict("records")]
    if file.suffix == ".json":
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as error:
            raise DataError(f"{what}: {file} is not valid JSON ({error})") from None
        if not isinstance(data, list):
            raise DataError(f"{what}: {file} must hold a JSON list of records")
        return data
    records = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise DataError(f"{what}: {file} line {number} is not valid JSON") from None
    return records
