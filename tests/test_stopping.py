"""A SIGINT or SIGTERM stops a command wherever it lands: where Python would drop the KeyboardInterrupt (a
finalizer, a weakref callback run by the garbage collector), the stop is kept and raised at the next check."""

from __future__ import annotations

import signal
import sys
import weakref

import pytest

from precsearch import cli
from precsearch.stopping import SignalStop, StopSignals


def _sigint_inside_a_weakref_callback() -> None:
    """A SIGINT whose handler runs inside a weakref callback, as when the garbage collector calls one:
    ``raise_signal`` runs the Python handler before it returns, and what the handler raises there Python
    reports as unraisable and drops."""
    class Collected:
        pass

    def callback(ref: weakref.ref) -> None:
        signal.raise_signal(signal.SIGINT)

    collected = Collected()
    ref = weakref.ref(collected, callback)
    del collected
    assert ref() is None


def test_a_signal_inside_a_finalizer_is_kept_and_raised_at_the_next_check():
    signals = StopSignals()

    class Finalized:
        def __del__(self):
            signals._handle(signal.SIGINT, sys._getframe())

    with signals:
        Finalized()  # Python would print 'Exception ignored in __del__' and drop a KeyboardInterrupt here
        assert signals.received == signal.SIGINT
        with pytest.raises(SignalStop) as stop:
            signals.check()
    assert stop.value.signum == signal.SIGINT


def test_a_stop_python_drops_in_a_weakref_callback_is_raised_at_the_next_check(capsys):
    with StopSignals() as signals:
        _sigint_inside_a_weakref_callback()  # the stop was raised in the callback, and Python dropped it
        assert signals.received == signal.SIGINT
        with pytest.raises(SignalStop) as stop:
            signals.check()
        signals.check()  # raised once: a later check does not raise it again
    assert stop.value.signum == signal.SIGINT
    assert "Exception ignored" not in capsys.readouterr().err
    assert sys.unraisablehook is not signals._unraisable  # the block put Python's hook back


def test_python_itself_drops_a_keyboard_interrupt_raised_in_a_weakref_callback(monkeypatch):
    """The oracle for the tests above and below: without StopSignals, this SIGINT is lost."""
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own: raises KeyboardInterrupt
    try:
        _sigint_inside_a_weakref_callback()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert dropped == [KeyboardInterrupt]


def test_a_sigint_dropped_while_the_cli_parses_its_arguments_still_stops_the_search(tmp_path, monkeypatch,
                                                                                   capsys):
    parser = cli.build_parser

    def parser_built_as_a_sigint_lands_in_a_gc_callback():
        built = parser()
        _sigint_inside_a_weakref_callback()
        return built

    monkeypatch.setattr(cli, "build_parser", parser_built_as_a_sigint_lands_in_a_gc_callback)
    out = tmp_path / "run"
    code = cli.main(["search", "tiny_cnn", "--trials", "2", "--out", str(out), "--no-progress", "--device", "cpu",
                     "--threads", "1", "--proxy-steps", "2", "--image-size", "8", "--batch-size", "16"])
    err = capsys.readouterr().err
    assert code == 130, err  # without the CLI's own handler the search ran both trials and exited 0
    assert err.strip().splitlines()[-1].startswith("precsearch search: stopped by SIGINT")
    assert "Exception ignored" not in err
    assert (out / "trials.csv").read_text().count("\n") <= 1  # stopped before its first phase: no trial
    assert not list((out / "checkpoints").glob("*"))  # and no calibration run
    assert not (out / "best.json").exists()
