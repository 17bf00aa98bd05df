"""Quick start: a LightningModule trained with GPipe over 2 pipeline stages on CPU.

Run it with `python examples/quickstart.py`.
"""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe import GPipeStrategy  # also registers strategy="gpipe"


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        # Every parameter lives in one nn.Sequential; the strategy cuts it into stages.
        self.layers = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
        )

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)  # computed on the last stage, over the whole batch
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    return TensorDataset(x, y)


if __name__ == "__main__":
    pl.seed_everything(0)
    model, data = Net(), dataset()
    x, y = data.tensors
    with torch.no_grad():
        before = F.mse_loss(model(x), y).item()

    trainer = pl.Trainer(
        strategy=GPipeStrategy(chunks=4),  # each batch of 64 runs as 4 micro-batches of 16
        accelerator="cpu",
        devices=2,  # 2 processes, one stage each
        max_epochs=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=64))

    # After fit, model.layers is the whole Sequential again, with every stage's trained weights.
    with torch.no_grad():
        after = F.mse_loss(model(x), y).item()
    if trainer.is_global_zero:  # rank 0 holds the last stage
        print(f"mse on the training data: {before:.4f} before fit, {after:.4f} after")
