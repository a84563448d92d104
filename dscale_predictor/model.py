"""The LightningModule: the runtime's `AcceptancePredictor` trained with the DESIGN 3.2 loss.

Position label j = 1 if the full-width accepted count y >= j. Loss = mean BCE over the positions +
0.02 x MSE between the raw sum of sigmoids (before monotonicity) and y, i.e. the mean over records of each
record's BCE mean + 0.02 x squared error.

Under DDP (any number of devices and nodes) a rank gets its part of the one-device batch (data.GlobalBatches);
its loss is its records' sum x world / global batch size, so DDP's average of the ranks' gradients is the
gradient of the global batch's mean: the same steps as on one device, up to float summation order.
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


def record_losses(logits: torch.Tensor, accepted: torch.Tensor,
                  position_weights: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, P], accepted [N] -> [N]: each record's mean BCE over the positions + 0.02 x squared count error.
    `position_weights` [P] (mean 1): the BCE's weighted mean over the positions instead (None: equal weights)."""
    labels = position_labels(accepted, logits.shape[1])
    bce = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    bce = bce.mean(-1) if position_weights is None else (bce * position_weights).sum(-1) / position_weights.sum()
    squared = (torch.sigmoid(logits).sum(-1) - accepted.float()) ** 2
    return bce + MSE_WEIGHT * squared


def predictor_loss(logits: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The DESIGN 3.2 loss of a batch: the mean of `record_losses`."""
    return record_losses(logits, accepted).mean()


class PredictorModule(L.LightningModule):
    def __init__(self, spec: dict, hidden_sizes: tuple[int, ...] = (224, 128), lr: float = 2e-3,
                 weight_decay: float = 0.01, mean: np.ndarray | None = None, std: np.ndarray | None = None,
                 position_weights: list[float] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["mean", "std"])
        self.model = AcceptancePredictor(FeatureSpec.from_dict(spec), tuple(hidden_sizes))
        num_positions = self.model.spec.num_positions
        if position_weights is not None and (len(position_weights) != num_positions
                                             or min(position_weights) < 0 or sum(position_weights) <= 0):
            raise ValueError(f"position_weights needs {num_positions} non-negative weights with a positive sum, got "
                             f"{list(position_weights)}")
        weights = None if position_weights is None else torch.tensor(position_weights, dtype=torch.float32)
        self.register_buffer("position_weights", weights, persistent=False)
        if mean is not None:
            self.model.norm_mean.copy_(torch.as_tensor(mean))
            self.model.norm_std.copy_(torch.as_tensor(std))

    def _losses(self, batch, name: str) -> tuple[torch.Tensor, int]:
        """This rank's part of a global batch -> (its records' loss sum, the global batch size); logs the mean."""
        x, y, global_size = batch  # [n, F], [n], int
        total = record_losses(self.model(x), y, self.position_weights).sum()
        # NOTE: a weighted mean over batches and ranks (sync_dist): the mean over all records, as on one device;
        # a rank with no records this step logs 0 with weight 0.
        self.log(name, total / max(len(y), 1), batch_size=len(y), prog_bar=True, on_step=False, on_epoch=True,
                 sync_dist=True)
        return total, global_size

    def training_step(self, batch, _):
        total, global_size = self._losses(batch, "train_loss")
        return total * (self.trainer.world_size / global_size)  # DDP averages over ranks: the global batch's mean

    def validation_step(self, batch, _):
        self._losses(batch, "val_loss")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, self.trainer.max_epochs))
        return {"optimizer": opt, "lr_scheduler": sched}
