"""Quick start: a plain LightningModule trained with GPipe over 2 pipeline stages on CPU.

    python examples/quickstart.py

The data are embedded (a fixed random regression problem); the loss printed at the end is the
last stage's true loss.
"""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpipe  # noqa: F401 - registers strategy="gpipe"


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
        )

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    return DataLoader(TensorDataset(x, y), batch_size=64)


if __name__ == "__main__":
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(chunks=4),
        accelerator="cpu",
        devices=2,
        max_epochs=5,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net(), data())
    if trainer.is_global_zero:
        print(f"final train_loss {trainer.callback_metrics['train_loss'].item():.4f}")
