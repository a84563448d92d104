"""The LightningModule: the runtime's `AcceptancePredictor` trained with the DESIGN 3.2 loss.

Position label j = 1 if the full-width accepted count y >= j. Loss = mean BCE over the positions +
0.02 x MSE between the raw sum of sigmoids (before monotonicity) and y.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from dscale_runtime.dvl.features import FeatureSpec
from dscale_runtime.dvl.predictor import AcceptancePredictor

MSE_WEIGHT = 0.02


def position_labels(accepted: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[N] accepted counts -> [N, P] float labels 1[y >= j], j = 1..P."""
    j = torch.arange(1, num_positions + 1, device=accepted.device)
    return (accepted[:, None] >= j[None, :]).float()


def predictor_loss(logits: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    labels = position_labels(accepted, logits.shape[1])
    bce = F.binary_cross_entropy_with_logits(logits, labels)
    mse = F.mse_loss(torch.sigmoid(logits).sum(-1), accepted.float())
    return bce + MSE_WEIGHT * mse


class PredictorModule(L.LightningModule):
    def __init__(self, spec: dict, hidden_sizes: tuple[int, ...] = (240, 128), lr: float = 2e-3,
                 weight_decay: float = 0.01, mean: np.ndarray | None = None, std: np.ndarray | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["mean", "std"])
        self.model = AcceptancePredictor(FeatureSpec.from_dict(spec), tuple(hidden_sizes))
        if mean is not None:
            self.model.norm_mean.copy_(torch.as_tensor(mean))
            self.model.norm_std.copy_(torch.as_tensor(std))

    def training_step(self, batch, _):
        x, y = batch
        loss = predictor_loss(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", predictor_loss(self.model(x), y), prog_bar=True, on_epoch=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, self.trainer.max_epochs))
        return {"optimizer": opt, "lr_scheduler": sched}
