"""Trace loading, the prompt-disjoint split and feature normalisation (fitted on the train split only).

The split is by prompt id (every record of a prompt lands in one split), stratified by dataset, and
deterministic for a seed: within each dataset the sorted prompt ids are shuffled by a seeded generator
and cut into train / val / test fractions.

Batches are the same on any number of devices (DDP): `GlobalBatches` draws one device's batches of
`batch_size` records (a permutation seeded by the seed and the epoch for training, logged order for validation) and hands every
rank its contiguous part of each, so the devices together see exactly the records one device would, step by
step; `PredictorModule` weighs each part so that DDP's gradient average is the global batch's mean.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dscale_runtime.dvl.features import FeatureSpec, same_drafter_family


class TraceError(ValueError):
    """Traces that cannot be used for training as given."""


@dataclass
class Traces:
    """All records of a trace folder as arrays (row order: shard order, then record order)."""

    features: np.ndarray  # [R, F] float32
    accepted: np.ndarray  # [R] int64, 0..W-1
    prompt_id: np.ndarray  # [R] object (str)
    dataset: np.ndarray  # [R] object (str)
    batch_id: np.ndarray  # [R] object (str): records of one verification batch share it
    concurrency: np.ndarray  # [R] int64
    manifest: dict
    temperature: np.ndarray | None = None  # [R] float64: the request's temperature (0 = greedy)
    sampling_rule: np.ndarray | None = None  # [R] object (str): greedy, top1 or sampled

    def __post_init__(self) -> None:
        if self.temperature is None:  # NOTE: format-1 folders hold one temperature, named in the manifest's config
            t = float(self.manifest.get("config", {}).get("temperature", 0.0) or 0.0)
            self.temperature = np.full(len(self.accepted), t)
        if self.sampling_rule is None:
            rule = "greedy" if not self.temperature.any() else "unknown"
            self.sampling_rule = np.full(len(self.accepted), rule, dtype=object)

    def subset(self, mask: np.ndarray) -> "Traces":
        return Traces(self.features[mask], self.accepted[mask], self.prompt_id[mask], self.dataset[mask],
                      self.batch_id[mask], self.concurrency[mask], self.manifest, self.temperature[mask],
                      self.sampling_rule[mask])

    def with_features(self, features: np.ndarray) -> "Traces":
        return Traces(features, self.accepted, self.prompt_id, self.dataset, self.batch_id, self.concurrency,
                      self.manifest, self.temperature, self.sampling_rule)

    def __len__(self) -> int:
        return len(self.accepted)


def read_traces(folder: str | Path) -> Traces:
    folder = Path(folder)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise TraceError(f"{folder}: no manifest.json; collect traces with dscale-collect first")
    manifest = json.loads(manifest_path.read_text())
    shards = sorted((folder / "shards").glob("*.parquet"))
    if not shards:
        raise TraceError(f"{folder}: no shards/*.parquet")
    cols = ["features", "accepted", "prompt_id", "dataset", "batch_id", "concurrency"]
    sampling = manifest.get("format_version", 1) >= 2  # per-record temperature and sampling rule
    tables = [pq.read_table(s, columns=cols + (["temperature", "sampling_rule"] if sampling else [])) for s in shards]
    width = manifest["feature_width"]
    feats = np.concatenate([np.asarray(t.column("features").combine_chunks().flatten(), dtype=np.float32)
                            .reshape(-1, width) for t in tables])
    get = lambda name: np.concatenate([t.column(name).to_numpy(zero_copy_only=False) for t in tables])  # noqa: E731
    return Traces(feats, get("accepted").astype(np.int64), get("prompt_id"), get("dataset"), get("batch_id"),
                  get("concurrency").astype(np.int64), manifest,
                  get("temperature").astype(np.float64).round(6) if sampling else None,
                  get("sampling_rule").astype(object) if sampling else None)


def select_traces(traces: Traces, spec: FeatureSpec, temperatures: list[float] | None,
                  feature_version: str | None) -> tuple[Traces, FeatureSpec]:
    """The records and layout a run trains on: only `temperatures` (a band predictor; None: all), in the layout of
    `feature_version` (None: the traces' own; v1 from v2 traces drops the sampling columns, a predictor blind to
    the temperature)."""
    if temperatures is not None:
        keep = np.isin(traces.temperature, np.round(np.asarray(temperatures, dtype=np.float64), 6))
        if not keep.any():
            raise TraceError(f"no records at temperatures {temperatures} (the traces hold "
                             f"{sorted(set(traces.temperature.tolist()))}); fix --temperatures")
        traces = traces.subset(keep)
    if feature_version is None or feature_version == spec.version:
        return traces, spec
    want = FeatureSpec.from_dict({**spec.to_dict(), "version": feature_version})
    if not same_drafter_family(want.version, spec.version):
        raise TraceError(f"--feature_version {feature_version}: the traces' {spec.version} columns read another "
                         "drafter's signals (DFlash 1 logits or DFlash 2 selector scores); pick a version of their family")
    if want.width > spec.width or want.names() != spec.names()[: want.width]:
        raise TraceError(f"--feature_version {feature_version}: its layout is not a prefix of the traces' "
                         f"{spec.version}; collect traces with it")
    return traces.with_features(np.ascontiguousarray(traces.features[:, : want.width])), want


def prompt_split(prompt_id: np.ndarray, dataset: np.ndarray, fractions: tuple[float, float, float],
                 seed: int) -> np.ndarray:
    """Split label per record: 0 train, 1 val, 2 test; grouped by prompt, stratified by dataset."""
    rng = np.random.default_rng(seed)
    assign: dict[str, int] = {}
    for name in sorted(set(dataset.tolist())):
        ids = np.array(sorted(set(prompt_id[dataset == name].tolist())))
        rng.shuffle(ids)
        n_val = int(round(fractions[1] * len(ids)))
        n_test = int(round(fractions[2] * len(ids)))
        for i, pid in enumerate(ids):
            assign[pid] = 2 if i < n_test else 1 if i < n_test + n_val else 0
    return np.array([assign[p] for p in prompt_id.tolist()], dtype=np.int64)


class TraceDataModule(L.LightningDataModule):
    def __init__(self, traces_dir: str, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), seed: int = 0,
                 batch_size: int = 1024, temperatures: list[float] | None = None,
                 feature_version: str | None = None) -> None:
        super().__init__()
        self.traces_dir = traces_dir
        self.fractions = fractions
        self.seed = seed
        self.batch_size = batch_size
        self.temperatures, self.feature_version = temperatures, feature_version
        self.splits: dict[str, Traces] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        traces = read_traces(self.traces_dir)
        # NOTE: split before selecting temperatures, so a band predictor's test prompts are the full set's.
        split = prompt_split(traces.prompt_id, traces.dataset, self.fractions, self.seed)
        spec = FeatureSpec.from_dict(traces.manifest["feature_spec"])
        for i, name in enumerate(("train", "val", "test")):
            self.splits[name], self.spec = select_traces(traces.subset(split == i), spec, self.temperatures,
                                                         self.feature_version)
        for name, part in self.splits.items():
            if not len(part):
                raise TraceError(f"{self.traces_dir}: the {name} split is empty; collect more prompts")
        train = self.splits["train"].features
        self.mean = train.mean(0)
        self.std = np.maximum(train.std(0), 1e-3)  # constant columns (e.g. one concurrency) stay finite

    def _loader(self, name: str, shuffle: bool) -> DataLoader:
        part = self.splits[name]
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        batches = GlobalBatches(len(part), self.batch_size, rank, world, shuffle, self.seed)
        # NOTE: batch_size=None: the sampler's items are whole batches, handed to RecordBatches as they are.
        return DataLoader(RecordBatches(part), sampler=batches, batch_size=None)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)


class GlobalBatches(Sampler):
    """One device's batches of an epoch, each cut into `world` contiguous parts; yields (this rank's part: record
    indices [n_r], the global batch's size). Every rank holds the same generator, so they agree on the batches."""

    def __init__(self, num_records: int, batch_size: int, rank: int, world: int, shuffle: bool, seed: int) -> None:
        self.num_records, self.batch_size, self.shuffle = num_records, batch_size, shuffle
        self.rank, self.world, self.seed = rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this before every epoch; a resumed run draws the epochs an uninterrupted one would."""
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.num_records // self.batch_size)

    def __iter__(self):
        # NOTE: the permutation is a function of (seed, epoch), not of how many epochs this process has run.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_records, generator=generator) if self.shuffle else torch.arange(
            self.num_records)  # [R]
        for batch in order.split(self.batch_size):
            # NOTE: parts differ in size by at most one (and are empty on some ranks when the batch is smaller than
            # the world); the loss weighs records by the global size, so that is exact.
            yield batch.tensor_split(self.world)[self.rank], len(batch)


class RecordBatches(Dataset):
    """Records by index batch: item (indices [n], global batch size) -> (features [n, F], accepted [n], size)."""

    def __init__(self, part: Traces) -> None:
        self.features = torch.from_numpy(part.features)
        self.accepted = torch.from_numpy(part.accepted)

    def __getitem__(self, item: tuple[torch.Tensor, int]):
        index, global_size = item
        return self.features[index], self.accepted[index], global_size
