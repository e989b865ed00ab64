"""A run directory agrees with its journal, and a report with its files (issue: trust boundaries).

Every record precsearch appends to a study's journal ends in a checksum chained to the record before it
(precsearch.search.storage.JournalFile), so ``search --resume`` and ``report --storage`` refuse a journal edited
by hand in one line naming the line, before Optuna replays it: a deleted queued trial (which left a trial
labelled "paper r=0.9" holding another assignment), a duplicated parameter record (a trial whose decisions and
key disagree), a changed accuracy (which became the pick's proxy accuracy), an unknown op code (Optuna said
"Should not reach."), a line added without a checksum. A journal of an older precsearch, without checksums, is
still resumed, with one WARNING, and what the resume appends is checked from then on. ``report`` refuses an
empty, cut or non-object best.json or run.json and an empty table in one line, and says plainly that a search
stopped before its first trial has no trials.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from optuna.storages.journal._storage import JournalOperation

from precsearch.cli import main
from precsearch.formats.runner import KernelRunner, KernelSettings, Runtime
from precsearch.search.rundir import LOCK_FILES
from precsearch.search.storage import CHECKSUM, JournalFile

# 3 trials of the 4 distinct assignments the paper's seeds queue: "paper r=1.0; all-low" stays queued; in the
# paper's bytes each of them trains (under the step's peak, tiny_cnn's assignments tie and some are not trained)
SEARCH = ["search", "tiny_cnn", "--trials", "3", "--proxy-steps", "4", "--proxy-seeds", "1", "--confirm-factor", "1",
          "--image-size", "8", "--batch-size", "16", "--device", "cpu", "--threads", "1", "--no-progress",
          "--memory", "bytes"]
ONE_SEED_WARNING = "one seed per proxy"  # the warning a search with --proxy-seeds 1 prints on stderr


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """Rounding kernels run eagerly: compiling costs more than these tiny proxies."""
    with Runtime(KernelRunner(KernelSettings(enabled=False))).as_default():
        yield


@pytest.fixture(scope="module")
def finished(space_file, tmp_path_factory) -> Path:
    """A finished tiny search."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with _eager(), contextlib.redirect_stdout(io.StringIO()):
        assert main([*SEARCH, "--space", str(space_file), "--out", str(out)]) == 0
    return out


def _lines(out: Path) -> list[bytes]:
    return (out / "study.journal").read_bytes().splitlines(keepends=True)


def _files(out: Path) -> dict[str, bytes]:
    """Every file of the run directory but the run lock (whose owner line each process taking it writes)."""
    return {str(path.relative_to(out)): path.read_bytes() for path in sorted(out.rglob("*"))
            if path.is_file() and path.name not in LOCK_FILES}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """main's exit status and its stderr without the one-seed warning."""
    code = main(argv)
    err = capsys.readouterr().err
    return code, "\n".join(line for line in err.splitlines() if ONE_SEED_WARNING not in line)


def _one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"precsearch {command}: error: "), err
    return lines[0]


def _find(lines: list[bytes], wanted) -> int:
    """The index of the first journal line whose record ``wanted(record)`` holds for."""
    return next(index for index, line in enumerate(lines) if wanted(json.loads(line)))


# Each edit returns the edited lines and the (1-based) line a refusal must name: the line after a deleted one, a
# duplicate, an edited or an added line.

def _delete_queued_r09(lines: list[bytes]) -> tuple[list[bytes], int]:
    """Delete the record queueing the paper's r=0.9 (its trial ran, and would now hold the next seed's origin)."""
    index = _find(lines, lambda r: r["op_code"] == JournalOperation.CREATE_TRIAL
                  and r["user_attrs"]["origin"] == ["paper r=0.9"])
    return lines[:index] + lines[index + 1:], index + 1


def _duplicate_param(lines: list[bytes]) -> tuple[list[bytes], int]:
    """Repeat a record setting a unit of trial 1 low (the copy is an intact line, in the wrong place)."""
    index = _find(lines, lambda r: r["op_code"] == JournalOperation.SET_TRIAL_PARAM and r["trial_id"] == 1
                  and r["param_value_internal"] == 1)
    return lines[:index + 1] + lines[index:], index + 2


def _raise_accuracy(lines: list[bytes], trial: int = 2) -> tuple[list[bytes], int]:
    """Raise the proxy accuracy ``trial`` recorded to 0.99."""
    index = _find(lines, lambda r: r["op_code"] == JournalOperation.SET_TRIAL_USER_ATTR
                  and r["trial_id"] == trial and "val_accuracy" in r["user_attr"])
    edited = re.sub(rb'"val_accuracy":[0-9.]+', b'"val_accuracy":0.99', lines[index])
    assert edited != lines[index]
    return [*lines[:index], edited, *lines[index + 1:]], index + 1


def _unknown_op_code(lines: list[bytes]) -> tuple[list[bytes], int]:
    """Give the last record (a study user attr) an op code Optuna does not know."""
    edited = lines[-1].replace(b'{"op_code":2,', b'{"op_code":99,', 1)
    assert edited != lines[-1]
    return [*lines[:-1], edited], len(lines)


def _append_unsigned(lines: list[bytes]) -> tuple[list[bytes], int]:
    """Append a well-formed record without a checksum, as a hand edit (or plain Optuna) would."""
    record = {"op_code": JournalOperation.SET_TRIAL_USER_ATTR, "worker_id": "x", "trial_id": 2,
              "user_attr": {"val_accuracy": 0.99}}
    return [*lines, json.dumps(record, separators=(",", ":")).encode() + b"\n"], len(lines) + 1


EDITS = {  # the edit, and what the refusal says of the line it names
    "a deleted queued trial": (_delete_queued_r09, "is not the record precsearch wrote after line"),
    "a duplicated line": (_duplicate_param, "is not the record precsearch wrote after line"),
    "a changed accuracy": (_raise_accuracy, "is not the record precsearch wrote after line"),
    "an unknown op code": (_unknown_op_code, "is garbled (op_code 99 is no journal operation)"),
    "a line without a checksum": (_append_unsigned, "has no checksum, unlike the lines before it"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_resume_refuses_a_journal_edited_by_hand_in_one_line_naming_the_line(edit, finished, space_file, tmp_path,
                                                                              capsys):
    change, phrase = EDITS[edit]
    edited, line = change(_lines(finished))
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "study.journal").write_bytes(b"".join(edited))
    before = _files(out)
    code, err = _run([*SEARCH, "--trials", "4", "--space", str(space_file), "--out", str(out), "--resume"], capsys)
    error = _one_error_line(err, "search")
    assert code == 2
    assert f"journal {out / 'study.journal'} is damaged: line {line} of {len(edited)} {phrase}" in error, error
    assert f"head -n {line - 1}" in error and "--resume" in error, error
    assert "Should not reach" not in err
    assert _files(out) == before  # nothing rewritten: not the tables, not the journal


def test_report_refuses_an_edited_journal_it_rebuilds_from(finished, tmp_path, capsys):
    edited, line = _raise_accuracy(_lines(finished))
    journal = tmp_path / "study.journal"
    journal.write_bytes(b"".join(edited))
    code, err = _run(["report", str(tmp_path / "rebuilt"), "--storage", str(journal)], capsys)
    assert code == 2 and f"line {line} of {len(edited)} is not the record" in _one_error_line(err, "report")
    assert not (tmp_path / "rebuilt").exists()


def test_keeping_the_lines_before_the_named_one_resumes(finished, space_file, tmp_path, capsys):
    """The fix the refusal gives works: the whole records before the named line are a journal cut there."""
    edited, line = _raise_accuracy(_lines(finished))
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "study.journal").write_bytes(b"".join(edited[:line - 1]))
    with _eager():
        code, err = _run([*SEARCH, "--space", str(space_file), "--out", str(out), "--resume"], capsys)
    assert code == 0, err
    JournalFile(out / "study.journal").check()  # what the resume appended chains on


def test_a_journal_without_checksums_resumes_with_one_warning_and_is_checked_after(finished, space_file, tmp_path,
                                                                                   capsys, caplog):
    """A journal an older precsearch wrote (no checksums) is resumed; what the resume appends carries them."""
    unsigned = [re.sub(rb',"' + CHECKSUM.encode() + rb'":"[0-9a-f]{16}"\}\n$', b"}\n", line)
                for line in _lines(finished)]
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "study.journal").write_bytes(b"".join(unsigned))
    with _eager(), caplog.at_level(logging.WARNING, logger="precsearch.search.storage"):
        code, err = _run([*SEARCH, "--trials", "4", "--space", str(space_file), "--out", str(out), "--resume"],
                         capsys)
    assert code == 0, err
    warned = [record.getMessage() for record in caplog.records if "have no checksum" in record.getMessage()]
    assert warned == [f"journal {out / 'study.journal'}: its first {len(unsigned)} record(s) have no checksum (an "
                      "older precsearch wrote them), so edits to them cannot be detected"]
    lines = _lines(out)
    assert lines[:len(unsigned)] == unsigned and len(lines) > len(unsigned)
    assert all(CHECKSUM.encode() in line for line in lines[len(unsigned):])
    edited, line = _raise_accuracy(lines[len(unsigned):], trial=3)  # an edit of what the resume wrote
    (out / "study.journal").write_bytes(b"".join(unsigned + edited))
    code, err = _run([*SEARCH, "--trials", "4", "--space", str(space_file), "--out", str(out), "--resume"], capsys)
    assert code == 2 and f"line {len(unsigned) + line} of" in _one_error_line(err, "search")


# ------------------------------------------------------------------------------------------------ report's files

REPORT_FILES = ("report.png", "report.md")


@pytest.mark.parametrize(("name", "text", "problem"), [
    ("best.json", "", ": empty JSON"),
    ("best.json", '{\n  "format": 1,\n  "provenance": {"tri', ": truncated or corrupted JSON (Unterminated string"),
    ("best.json", "[1, 2]\n", " is a JSON list, not an object"),
    ("best.json", '{"provenance": 3}\n', " has no provenance object"),
    ("run.json", "{", ": truncated or corrupted JSON (Expecting property name"),
    ("trials.csv", "", " is empty"),
    ("trials.csv", "number,state,ori", " is cut inside its header line"),
])
def test_report_refuses_a_damaged_file_in_one_line_naming_it(name, text, problem, finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / name).write_text(text)
    code, err = _run(["report", str(out)], capsys)
    error = _one_error_line(err, "report")
    assert code == 2
    assert f"{out / name}{problem}" in error and "--storage" in error, error
    assert not [name for name in REPORT_FILES if (out / name).exists()]


def test_report_says_plainly_that_a_search_stopped_before_its_first_trial_has_none(finished, tmp_path, capsys,
                                                                                    caplog):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    header = (out / "trials.csv").read_text().splitlines(keepends=True)[0]
    (out / "trials.csv").write_text(header)  # what export writes then: the header of a table without rows
    with caplog.at_level(logging.WARNING, logger="precsearch.analysis.report"):
        code, err = _run(["report", str(out)], capsys)
    assert code == 0, err
    assert [record.getMessage() for record in caplog.records] == [
        f"{out / 'trials.csv'} holds no trials: the search stopped before its first trial (precsearch search "
        "--resume continues it); the report shows no trials"]
    assert "- trials: none (the search stopped before its first trial)" in (out / "report.md").read_text()
