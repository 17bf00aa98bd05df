"""The recipes' CSV logger: written out at every checkpoint, continued by a resumed job."""

from __future__ import annotations

import csv
from pathlib import Path

from recipes.resumable_csv_logger import ResumableCSVLogger


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _stopped_job(directory: Path) -> Path:
    """A ``metrics.csv`` as a job stopped after step 9 left it: an entropy row, losses at 0..9."""
    logger = ResumableCSVLogger(save_dir=directory, name="", version="")
    logger.log_metrics({"val_unigram_entropy": 2.5}, step=0)
    for step in range(10):
        logger.log_metrics({"train_loss": 10.0 - step}, step=step)
    logger.save()
    return logger.metrics_path


def test_a_resumed_logger_keeps_the_rows_before_its_first_step_and_drops_the_rest(tmp_path):
    path = _stopped_job(tmp_path)
    logger = ResumableCSVLogger(save_dir=tmp_path, name="", version="", resume=True)
    assert logger.found("val_unigram_entropy") and not logger.found("val_loss")
    for step in range(6, 8):  # resumed from the checkpoint of step 6
        logger.log_metrics({"train_loss": 0.5, "val_loss": 0.25}, step=step)
    logger.save()
    rows = _rows(path)
    assert [(r["step"], r["train_loss"], r["val_unigram_entropy"]) for r in rows] == [
        ("0", "", "2.5"),
        *[(str(s), str(10.0 - s), "") for s in range(6)],
        ("6", "0.5", ""),
        ("7", "0.5", ""),
    ]
    assert [r["val_loss"] for r in rows[-2:]] == ["0.25", "0.25"]


def test_a_fresh_logger_starts_a_new_file(tmp_path):
    path = _stopped_job(tmp_path)
    logger = ResumableCSVLogger(save_dir=tmp_path, name="", version="")
    assert not logger.found("val_unigram_entropy")
    logger.log_metrics({"train_loss": 1.0}, step=0)
    logger.save()
    assert [(r["step"], r["train_loss"]) for r in _rows(path)] == [("0", "1.0")]


def test_rows_are_written_out_at_each_checkpoint(tmp_path):
    logger = ResumableCSVLogger(save_dir=tmp_path, name="", version="")
    logger.log_metrics({"train_loss": 1.0}, step=0)
    assert not logger.metrics_path.exists()  # CSVLogger holds rows for 100 steps
    logger.after_save_checkpoint(None)
    assert [r["train_loss"] for r in _rows(logger.metrics_path)] == ["1.0"]
