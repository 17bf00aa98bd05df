"""A CSV logger for a job that may be stopped and resumed in its own directory (issue 41, item 6)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from lightning_fabric.utilities.rank_zero import rank_zero_only
from pytorch_lightning.loggers import CSVLogger
from typing_extensions import override


class ResumableCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger``, written out at every checkpoint and able to continue its file.

    ``CSVLogger`` keeps rows in memory until every ``flush_logs_every_n_steps`` (100) steps, so a
    killed job's ``metrics.csv`` lacks the rows since the last flush; this one also writes them
    whenever a checkpoint is saved, so the file has every row up to the job's last checkpoint.
    ``CSVLogger`` removes a ``metrics.csv`` it finds; with ``resume=True`` this one keeps its rows:
    at the first metrics the run logs, the rows at or after that step (what the stopped job logged
    after the checkpoint it resumes from, and which the resumed run logs again) are dropped, and
    the new rows follow the others under one header. Rank 0 only, as ``CSVLogger``.

    Args:
        *args, **kwargs: ``CSVLogger``'s (``save_dir``, ``name``, ``version``, ...).
        resume (bool): continue the ``metrics.csv`` in the log directory (default: False).
    """

    def __init__(self, *args: Any, resume: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume = resume
        self._found: list[dict[str, str]] | None = None  # the rows found, until the first new step
        self._found_keys: set[str] = set()

    @property
    def metrics_path(self) -> Path:
        """The ``metrics.csv`` this logger writes."""
        return Path(self.log_dir) / "metrics.csv"

    def found(self, key: str) -> bool:
        """Whether the ``metrics.csv`` this logger continues had a value in column ``key``."""
        self.experiment  # noqa: B018 (reads the file the writer then replaces)
        return key in self._found_keys

    @property
    @override
    def experiment(self) -> Any:
        if (
            self._experiment is None
            and self.resume
            and rank_zero_only.rank == 0
            and self.metrics_path.is_file()
        ):
            with self.metrics_path.open(newline="") as handle:
                self._found = list(csv.DictReader(handle))  # before the writer removes the file
            self._found_keys = {key for row in self._found for key, value in row.items() if value}
        return super().experiment

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        writer = self.experiment
        if self._found is not None:
            first = step if step is not None else 0
            kept = [row for row in self._found if int(float(row["step"])) < first]
            self._found = None
            if kept:
                keys = sorted({key for row in kept for key, value in row.items() if value})
                with self.metrics_path.open("w", newline="") as handle:
                    out = csv.DictWriter(handle, fieldnames=keys)
                    out.writeheader()
                    out.writerows([{key: row.get(key, "") for key in keys} for row in kept])
                writer.metrics_keys = keys
        super().log_metrics(metrics, step)

    @override
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Write the rows logged so far (Lightning calls it on rank 0 after each checkpoint)."""
        self.save()
