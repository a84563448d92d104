"""The acceptance predictor at inference: module, artifact format and loading, scores and seeds.

An artifact is data (`torch.load(weights_only=True)`): weights, feature normalisation, the feature spec,
the hidden-state projection, and the identity of the target/drafter pair it was trained for. Loading
checks all of it and names what does not match. Scores are sigmoid outputs made non-increasing along the
draft positions by a cumulative minimum, then, where the artifact has one, mapped by the calibration of the
request's temperature band (fitted by `dscale-train` on the validation split; the live map's form,
`dvl.calibration`); seeds are k0 = 1 + round(sum_j s_j), clipped to [1, W].
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from dscale_runtime.dvl.calibration import calibrated_scores, conditional_scores
from dscale_runtime.dvl.features import FEATURE_VERSIONS, FeatureSpec, hidden_projection, same_drafter_family
from dscale_runtime.models.config import DFlashConfig, Qwen3Config
from dscale_runtime.models.loader import file_sha256

ARTIFACT_FORMAT = "dscale-acceptance-predictor"
ARTIFACT_VERSION = 1


class PredictorError(ValueError):
    """A predictor artifact that cannot be used with this runtime or this model pair."""


class AcceptancePredictor(nn.Module):
    """Normalised features -> MLP -> one logit per draft position (P(accepted >= j))."""

    def __init__(self, spec: FeatureSpec, hidden_sizes: tuple[int, ...] = (224, 128)) -> None:
        super().__init__()
        self.spec = spec
        self.hidden_sizes = tuple(hidden_sizes)
        self.register_buffer("norm_mean", torch.zeros(spec.width))
        self.register_buffer("norm_std", torch.ones(spec.width))
        layers: list[nn.Module] = []
        width = spec.width
        for h in self.hidden_sizes:
            layers += [nn.Linear(width, h), nn.GELU()]
            width = h
        layers.append(nn.Linear(width, spec.num_positions))
        self.mlp = nn.Sequential(*layers)

        self.calibration_temperatures: tuple[float, ...] = ()
        self.register_buffer("calibration_knots", None, persistent=False)
        self.register_buffer("calibration_edges", None, persistent=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, width] -> raw logits [N, P] (training applies BCE to these)."""
        x = (features.float() - self.norm_mean) / self.norm_std
        return self.mlp(x)

    def set_calibration(self, temperatures: list[float] | tuple[float, ...], knots: torch.Tensor | None) -> None:
        """The offline calibration per temperature band (`dscale-train` fits it on the validation split): band b
        holds the requests whose temperature is nearest `temperatures[b]` (sorted; ties to the lower one), and
        maps their conditionals through `knots[b]` ([B, P, K + 1], the live map's form,
        `dvl.calibration`). None removes it. Several bands need the spec's temperature column."""
        if knots is None:
            self.calibration_temperatures, self.calibration_knots, self.calibration_edges = (), None, None
            return
        temps = [float(t) for t in temperatures]
        knots = torch.as_tensor(knots, dtype=torch.float32)
        if temps != sorted(set(temps)) or knots.ndim != 3 or knots.shape[0] != len(temps) \
                or knots.shape[1] != self.spec.num_positions or knots.shape[2] < 2:
            raise PredictorError(f"calibration: knots of shape {tuple(knots.shape)} for temperatures {temps}; "
                                 f"expected [bands, {self.spec.num_positions}, K + 1] over sorted distinct temperatures")
        if len(temps) > 1 and self.spec.temperature_column is None:
            raise PredictorError(f"calibration: {len(temps)} temperature bands, but features '{self.spec.version}' "
                                 "carry no temperature")
        if not bool(torch.isfinite(knots).all()) or knots.min() < 0 or knots.max() > 1 \
                or bool((knots.diff(dim=-1) < 0).any()):
            raise PredictorError("calibration: knot values must be non-decreasing in [0, 1]")
        edges = torch.tensor([(a + b) / 2 for a, b in zip(temps, temps[1:])], dtype=torch.float32)
        device = self.norm_mean.device
        self.calibration_temperatures = tuple(temps)
        self.calibration_knots, self.calibration_edges = knots.to(device), edges.to(device)

    def uncalibrated_scores(self, features: torch.Tensor) -> torch.Tensor:
        """Sigmoid, then cumulative minimum along the positions [N, P]."""
        return torch.sigmoid(self(features)).cummin(dim=-1).values

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        """Monotone acceptance scores s [N, P]: the uncalibrated ones, through the temperature band's map when the
        artifact has a calibration (graph-safe: static shapes, no host read)."""
        raw = self.uncalibrated_scores(features)
        if self.calibration_knots is None:
            return raw
        return calibrated_scores(conditional_scores(raw), self.band_knots(features))

    def band_knots(self, features: torch.Tensor) -> torch.Tensor:
        """Each row's map [N, P, K + 1] (its temperature band's knots)."""
        if len(self.calibration_temperatures) == 1:
            return self.calibration_knots.expand(features.shape[0], -1, -1)
        # NOTE: the count of band edges below the temperature (torch.bucketize's answer, in ops ONNX exports).
        temperature = features[:, self.spec.temperature_column].float()
        band = (temperature.unsqueeze(1) > self.calibration_edges.unsqueeze(0)).long().sum(1)
        return self.calibration_knots.index_select(0, band)


def seed_lengths(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """k0 = 1 + round(sum_j s_j), clipped to [1, W]; scores [N, W-1] -> [N] int64."""
    # NOTE: floor(x + 0.5) rather than round-half-to-even, so equal sums give equal seeds on every device.
    return (1 + torch.floor(scores.sum(-1) + 0.5)).clamp(1, block_size).long()


def pair_identity(target: Qwen3Config, drafter: DFlashConfig) -> dict:
    """What an artifact must agree on with the models it runs beside."""
    identity = {
        "target": {"hidden_size": target.hidden_size, "num_hidden_layers": target.num_hidden_layers,
                   "vocab_size": target.vocab_size},
        "drafter": {"hidden_size": drafter.layers.hidden_size, "num_hidden_layers": drafter.layers.num_hidden_layers,
                    "block_size": drafter.block_size, "target_layer_ids": list(drafter.target_layer_ids),
                    "mask_token_id": drafter.mask_token_id},
    }
    if drafter.dflash2 is not None:
        # NOTE: a DFlash 2 drafter's features read its selector's scores: a DFlash 1 predictor (no such key) is
        # refused beside it. DFlash 1 identities keep their keys, so existing artifacts still load.
        identity["drafter"]["architecture"] = drafter.architecture
    return identity


def predictor_artifact(model: AcceptancePredictor, identity: dict, projection: torch.Tensor,
                       metrics: dict | None = None, names: dict | None = None) -> dict:
    """The artifact dict for `torch.save` (plain tensors, lists, numbers and strings only)."""
    return {
        "format": ARTIFACT_FORMAT,
        "format_version": ARTIFACT_VERSION,
        "feature_spec": model.spec.to_dict(),
        "hidden_sizes": list(model.hidden_sizes),
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "hidden_projection": projection.detach().cpu().float().clone(),
        "identity": identity,
        "calibration": ({"temperatures": list(model.calibration_temperatures),
                         "knots": model.calibration_knots.detach().cpu().clone()}
                        if model.calibration_knots is not None else None),
        "names": names or {},
        "metrics": metrics or {},
    }


def load_predictor(path: str | Path, identity: dict | None = None, spec: FeatureSpec | None = None,
                   device: str | torch.device = "cpu",
                   drafter_folder: str | Path | None = None) -> tuple[AcceptancePredictor, torch.Tensor]:
    """Load and check an artifact; returns (predictor, hidden projection). `identity` is `pair_identity(...)`
    of the models it will run with (None skips that check, e.g. for offline inspection). When the artifact
    records the drafter's weight hashes and `drafter_folder` is given, the drafter's files must match them
    (a retrained drafter of the same shape drafts differently: its predictor must be retrained too)."""
    path = Path(path)
    if not path.is_file():
        raise PredictorError(f"{path}: no predictor artifact (train one with dscale-train, or pass --predictor)")
    try:
        art = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the file is not a safe artifact
        raise PredictorError(f"{path}: not a loadable predictor artifact ({type(exc).__name__}: {exc})") from exc
    if not isinstance(art, dict) or art.get("format") != ARTIFACT_FORMAT:
        raise PredictorError(f"{path}: not a DScale predictor artifact (missing format '{ARTIFACT_FORMAT}')")
    if art.get("format_version") != ARTIFACT_VERSION:
        raise PredictorError(f"{path}: artifact format_version {art.get('format_version')}, this runtime reads "
                             f"{ARTIFACT_VERSION}")
    version = (art.get("feature_spec") or {}).get("version") if isinstance(art.get("feature_spec"), dict) else None
    if version not in FEATURE_VERSIONS:
        raise PredictorError(f"{path}: feature spec version '{version}', this runtime computes "
                             f"{', '.join(FEATURE_VERSIONS)}; retrain the predictor on traces collected with one of them")
    try:
        got = FeatureSpec.from_dict(art["feature_spec"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PredictorError(f"{path}: unreadable 'feature_spec' ({exc})") from exc
    # NOTE: the runtime computes any known version of the drafter's family (the engine takes the layout from the
    # artifact: v1 or v2); `spec` (the drafter's own, `drafter_feature_spec`) pins the family and the layout.
    if spec is not None and not same_drafter_family(got.version, spec.version):
        raise PredictorError(f"{path}: trained on features '{got.version}', but this drafter's steps compute "
                             f"'{spec.version}' (DFlash 1 and DFlash 2 drafters differ); retrain the predictor on "
                             "traces collected with this drafter")
    if spec is not None and got != dataclasses.replace(spec, version=got.version):
        raise PredictorError(f"{path}: feature spec {got.to_dict()} differs from the runtime's {spec.to_dict()}")
    if identity is not None:
        for part in ("target", "drafter"):
            stored = art.get("identity", {}).get(part, {})
            for key, value in identity[part].items():
                if stored.get(key) != value:
                    raise PredictorError(f"{path}: trained for a {part} with {key}={stored.get(key)}, but the "
                                         f"loaded {part} has {key}={value}")
    weights = art.get("identity", {}).get("drafter_weights") or {}
    if drafter_folder is not None:
        for name, digest in weights.items():
            file = Path(drafter_folder) / name
            if not file.is_file() or file_sha256(file) != digest:
                raise PredictorError(f"{path}: trained with drafter weights {name} (sha256 {digest[:12]}...), but "
                                     f"{file} differs; retrain the predictor on traces of this drafter")
    projection = art.get("hidden_projection")
    d = identity["drafter"]["hidden_size"] if identity is not None else None
    if not isinstance(projection, torch.Tensor) or projection.ndim != 2 or projection.shape[1] != got.hidden_proj_dim \
            or (d is not None and projection.shape[0] != d):
        raise PredictorError(f"{path}: 'hidden_projection' has shape "
                             f"{getattr(projection, 'shape', None)}, expected [{d}, {got.hidden_proj_dim}]")
    if not torch.equal(projection, hidden_projection(got, projection.shape[0])):
        raise PredictorError(f"{path}: 'hidden_projection' is not the spec's seeded projection (tampered artifact)")
    model = AcceptancePredictor(got, tuple(art.get("hidden_sizes", ())))
    try:
        model.load_state_dict(art["state_dict"], strict=True)
    except (KeyError, RuntimeError) as exc:
        raise PredictorError(f"{path}: weights do not fit the declared architecture ({exc})") from exc
    calibration = art.get("calibration")
    if calibration is not None:
        if not isinstance(calibration, dict) or not isinstance(calibration.get("knots"), torch.Tensor):
            raise PredictorError(f"{path}: unreadable 'calibration' (expected temperatures and a knots tensor)")
        try:
            model.set_calibration(calibration.get("temperatures") or [], calibration["knots"])
        except PredictorError as exc:
            raise PredictorError(f"{path}: {exc}") from exc
    return model.to(device).eval(), projection.to(device)
