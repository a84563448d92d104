"""Export: `artifacts/<name>.pt` (the runtime's artifact format) and `artifacts/<name>.onnx`.

The ONNX graph takes raw features [N, F] and returns the monotone scores [N, P] (normalisation, MLP,
sigmoid and the cumulative minimum, unrolled as pairwise minima so every opset runs it, then the artifact's
temperature-band calibration where it has one, its cumulative product unrolled the same way).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dscale_runtime.dvl.calibration import conditional_scores, mapped_conditionals
from dscale_runtime.dvl.predictor import AcceptancePredictor, predictor_artifact


class ScoresForExport(nn.Module):
    def __init__(self, model: AcceptancePredictor) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        probs = torch.sigmoid(self.model(features))
        cols = [probs[:, :1]]
        for j in range(1, probs.shape[1]):
            cols.append(torch.minimum(cols[-1], probs[:, j : j + 1]))
        scores = torch.cat(cols, dim=1)
        if self.model.calibration_knots is None:
            return scores
        # The artifact's temperature-band calibration, as `AcceptancePredictor.scores` applies it (cumprod unrolled).
        mapped = mapped_conditionals(conditional_scores(scores), self.model.band_knots(features))
        cols = [mapped[:, :1]]
        for j in range(1, mapped.shape[1]):
            cols.append(cols[-1] * mapped[:, j : j + 1])
        return torch.cat(cols, dim=1)


def export_pt(model: AcceptancePredictor, path: Path, identity: dict, projection: torch.Tensor, metrics: dict,
              names: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(predictor_artifact(model.cpu().eval(), identity, projection, metrics, names), path)
    return path


def export_onnx(model: AcceptancePredictor, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = ScoresForExport(model.cpu().eval())
    example = torch.zeros(2, model.spec.width)
    torch.onnx.export(wrapper, (example,), str(path), input_names=["features"], output_names=["scores"],
                      dynamic_axes={"features": {0: "batch"}, "scores": {0: "batch"}}, opset_version=17,
                      dynamo=False)
    return path
