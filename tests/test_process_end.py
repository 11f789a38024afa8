"""Ending a process on purpose (fedml_adapter/process_end.py): nothing written before the end is lost."""
from __future__ import annotations

import subprocess
import textwrap

from fedml_fedmitr.fedml_adapter import process_end

from conftest import PYTHON, child_env


def test_exit_process_keeps_buffered_output_and_log_lines(tmp_path):
    log_file = tmp_path / "run.log"
    script = textwrap.dedent(f"""
        import logging, sys
        from fedml_fedmitr.fedml_adapter.process_end import exit_process
        handler = logging.StreamHandler(open({str(log_file)!r}, "w", buffering=1 << 16))
        logging.getLogger("fedml_fedmitr").addHandler(handler)
        logging.getLogger("fedml_fedmitr").warning("last log line")
        sys.stdout.write("last stdout text without newline")
        exit_process(3)
        print("never reached")
    """)
    proc = subprocess.run([PYTHON, "-c", script], env=child_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == "last stdout text without newline"  # block-buffered into a pipe, still flushed
    assert log_file.read_text() == "last log line\n"


def test_abort_mpi_job_flushes_pauses_then_aborts_with_the_code(monkeypatch):
    events = []

    class FakeComm:
        def Abort(self, code):
            events.append(("abort", code))

    monkeypatch.setattr(process_end, "flush_output", lambda: events.append(("flush",)))
    monkeypatch.setattr(process_end.time, "sleep", lambda s: events.append(("sleep", s)))
    process_end.abort_mpi_job(7, FakeComm())
    assert events == [("flush",), ("sleep", process_end.FORWARD_PAUSE_S), ("abort", 7)]
    assert process_end.FORWARD_PAUSE_S > 0
