"""The trace folder: Parquet shards written atomically, and `manifest.json` describing what made them.

Layout: `<output>/manifest.json`, `<output>/shards/c<concurrency>-t<temperature x 1000>-chunk<k>.parquet` (format
version 2; version 1 folders name shards `c<concurrency>-chunk<k>.parquet` and hold no sampling columns: readers
take their one temperature from the manifest's config). A shard is written
to a temporary name and renamed into place, so after a crash a shard either exists whole or not at all;
resuming skips the chunks whose shard exists. A folder whose manifest names another feature spec, other
model files or another collection setup is refused. Workers of one launch write their own shards into the
folder side by side (each chunk has one owner); only rank 0 writes `manifest.json`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dscale_runtime.models.loader import file_sha256

TRACE_FORMAT = "dscale-traces"
TRACE_VERSION = 2
"""2: per-record `temperature` and `sampling_rule` columns, the temperature in shard names (1: neither)."""
SAMPLING_RULE_NAMES = ("greedy", "top1", "sampled")  # the runner's rule codes 0, 1, 2


class TraceFolderError(ValueError):
    """A trace folder that does not belong to this collection."""


def schema(width: int) -> pa.Schema:
    return pa.schema([
        ("prompt_id", pa.string()),
        ("dataset", pa.string()),
        ("concurrency", pa.int32()),
        ("request_id", pa.string()),
        ("step", pa.int32()),
        ("batch_id", pa.string()),
        ("num_live", pa.int32()),
        ("context_len", pa.int32()),
        ("accepted", pa.int32()),
        ("features", pa.list_(pa.float32(), width)),
        ("temperature", pa.float32()),
        ("sampling_rule", pa.string()),
    ])


def model_files(folder: str | Path) -> dict[str, str]:
    """sha256 of every config and weight file of a checkpoint folder."""
    folder = Path(folder)
    names = sorted(p for p in folder.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())
    return {p.name: file_sha256(p) for p in names}


def software_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "datasets", "pyarrow", "dscale"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class TraceStore:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.shards = self.folder / "shards"

    @property
    def manifest_path(self) -> Path:
        return self.folder / "manifest.json"

    def open(self, identity: dict) -> dict:
        """Create the folder or check that it holds this collection; returns the manifest."""
        self.shards.mkdir(parents=True, exist_ok=True)
        for stray in self.shards.glob(".*.tmp"):
            stray.unlink()  # a shard that was being written when the last run died
        if self.manifest_path.is_file():
            manifest = json.loads(self.manifest_path.read_text())
            if manifest.get("format_version") != TRACE_VERSION:
                raise TraceFolderError(f"{self.manifest_path}: trace format version {manifest.get('format_version')}, "
                                       f"this collector writes {TRACE_VERSION}; use another --output folder (the "
                                       "trainer still reads the old one)")
            for key, value in identity.items():
                if manifest.get(key) != value:
                    raise TraceFolderError(
                        f"{self.manifest_path}: this folder was collected with a different '{key}' "
                        f"({json.dumps(manifest.get(key), sort_keys=True)[:300]} vs "
                        f"{json.dumps(value, sort_keys=True)[:300]}); use another --output folder")
            return manifest
        if any(self.shards.glob("*.parquet")):
            raise TraceFolderError(f"{self.folder}: shards without a manifest.json; use another --output folder")
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        manifest = {"format": TRACE_FORMAT, "format_version": TRACE_VERSION, **identity,
                    "software": software_versions(), "created": now, "counts": {}}
        write_json_atomic(self.manifest_path, manifest)
        return manifest

    def shard_path(self, concurrency: int, chunk: int, temperature: float = 0.0) -> Path:
        return self.shards / f"c{concurrency:03d}-t{round(temperature * 1000):04d}-chunk{chunk:05d}.parquet"

    def has_shard(self, concurrency: int, chunk: int, temperature: float = 0.0) -> bool:
        return self.shard_path(concurrency, chunk, temperature).is_file()

    def write_shard(self, concurrency: int, chunk: int, rows: dict, width: int, temperature: float = 0.0) -> None:
        path = self.shard_path(concurrency, chunk, temperature)
        tmp = path.with_name(f".{path.name}.tmp")
        table = pa.table(rows, schema=schema(width))
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def update_counts(self, manifest: dict) -> dict:
        counts: dict = {"shards": 0, "records": 0, "by_concurrency": {}, "by_temperature": {}}
        for path in sorted(self.shards.glob("*.parquet")):
            n = pq.ParquetFile(path).metadata.num_rows
            c = str(int(path.name[1:4]))
            t = str(int(path.name.split("-")[1][1:]) / 1000)
            counts["shards"] += 1
            counts["records"] += n
            counts["by_concurrency"][c] = counts["by_concurrency"].get(c, 0) + n
            counts["by_temperature"][t] = counts["by_temperature"].get(t, 0) + n
        manifest["counts"] = counts
        manifest["updated"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        write_json_atomic(self.manifest_path, manifest)
        return manifest
