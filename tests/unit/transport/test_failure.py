"""A failure's traceback is printed once: by the report, and a one-line pointer where the exception ends
the process (the uncaught-exception hook, wrapped by ``init_process_group`` as in a job)."""

import sys

import pytest
import torch.distributed as dist

from lightning_gpipe.transport import failure, liveness


@pytest.fixture
def hooks(monkeypatch):
    """This process' hook replaced by a recorder of what it is given; ``point_at_reports`` not yet run."""
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    monkeypatch.setattr(failure, "_hook", {})
    monkeypatch.setattr(failure, "abort_process_group", lambda: None)
    monkeypatch.setattr(liveness, "leave", lambda why: None)
    return seen


def _raised(exception: BaseException) -> BaseException:
    try:
        raise exception
    except BaseException as err:  # noqa: BLE001
        return err


def _uncaught(exception: BaseException) -> None:
    sys.excepthook(type(exception), exception, exception.__traceback__)


def test_an_exception_the_report_printed_ends_the_process_with_one_line_naming_the_rank(hooks, capsys):
    failure.point_at_reports()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # wraps the hook: "[rank0]"
    try:
        own = _raised(ValueError("bad batch"))
        failure.report_and_abort(own, "stage 1 (rank 0)")
        report = capsys.readouterr().err
        assert report.startswith("[lightning_gpipe] stage 1 (rank 0) failed: ValueError: bad batch\n")
        assert report.count("Traceback (most recent call last)") == 1
        _uncaught(own)
        assert capsys.readouterr().err == (
            "[rank0]: [lightning_gpipe] stage 1 (rank 0) exits on the ValueError reported above "
            '(its traceback follows "[lightning_gpipe] stage 1 (rank 0) failed")\n'
        )
        assert hooks == [own]  # the user's hook still sees the error that ends the process
        other = _raised(KeyError("x"))  # not reported: the hook wrapped prints it, as before
        _uncaught(other)
        assert hooks == [own, other]
    finally:
        dist.destroy_process_group()


def test_under_the_interpreters_own_hook_a_reported_exception_prints_only_the_pointer(
    hooks, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    failure.point_at_reports()
    own = _raised(ValueError("bad batch"))
    failure.report_and_abort(own, "stage 0 (rank 1)")
    capsys.readouterr()
    _uncaught(own)
    assert capsys.readouterr().err == (
        "[lightning_gpipe] stage 0 (rank 1) exits on the ValueError reported above "
        '(its traceback follows "[lightning_gpipe] stage 0 (rank 1) failed")\n'
    )
    other = _raised(KeyError("x"))
    _uncaught(other)
    assert capsys.readouterr().err.count("Traceback (most recent call last)") == 1


def test_a_peers_consequence_is_not_marked_and_prints_in_full(hooks, monkeypatch):
    monkeypatch.setattr(failure, "_other_ranks", lambda: [])
    failure.point_at_reports()
    broken = _raised(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    failure.report_and_abort(broken, "stage 0 (rank 1)")
    assert not hasattr(broken, failure.REPORTED)
    _uncaught(broken)
    assert hooks == [broken]


def test_the_hook_wraps_once_per_process(hooks):
    failure.point_at_reports()
    failure.point_at_reports()  # a later job of the process: the first wrap stays, nothing wrapped twice
    assert sys.excepthook is failure.excepthook
    other = _raised(KeyError("x"))
    _uncaught(other)
    assert hooks == [other]


def _step():
    raise ValueError("bad batch")


def _handled():  # as Lightning's _call_and_handle_interrupt: the report runs inside the except
    try:
        _step()
    except ValueError as err:
        failure.report_and_abort(err, "stage 0 (rank 1)")
        raise


def _fit():  # as trainer.fit: a caller of the frame that caught the error
    _handled()


def test_the_report_prints_the_callers_of_the_frame_that_caught_the_error_as_the_interpreter_would(
    hooks, capsys
):
    """The pointer stands in for the uncaught traceback, so the report holds its frames from the top (the
    script's line that called ``fit``), not only those from the frame that caught the error."""
    with pytest.raises(ValueError, match="bad batch"):
        _fit()
    report = capsys.readouterr().err
    assert report.count("Traceback (most recent call last)") == 1
    here = report.index("in test_the_report_prints_the_callers")
    assert here < report.index("in _fit") < report.index("in _handled") < report.index("in _step"), report
    assert report.rstrip().endswith("ValueError: bad batch")


def test_a_system_exit_is_reported_in_one_line_without_a_traceback(hooks, capsys, monkeypatch):
    """``sys.exit(3)`` in a callback: the rank still leaves naming why, but prints no traceback, as Python
    prints none for it; any other error keeps its traceback."""
    left = []
    monkeypatch.setattr(liveness, "leave", left.append)
    failure.report_and_abort(_raised(SystemExit(3)), "stage 1 (rank 0)")
    assert capsys.readouterr().err == "[lightning_gpipe] stage 1 (rank 0) failed: SystemExit: 3\n"
    assert left == ["stage 1 (rank 0) failed: SystemExit: 3"]
    failure.report_and_abort(_raised(ValueError("bad")), "stage 1 (rank 0)")
    assert capsys.readouterr().err.count("Traceback (most recent call last)") == 1
