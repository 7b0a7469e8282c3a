"""The ``ckptstore`` command for scripts and operators: ``verify --all``, ``--json`` on every
command (errors too), the progress line (only on a terminal, only for long work) and the
documented exit statuses."""

from __future__ import annotations

import json
import os
import pty
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import ckptstore
from ckptstore.cli import main
from ckptstore.cli import output as cli_output
from ckptstore.cli.output import EXIT_STATUSES
from ckptstore.runtime.progress import Progress

DOCS = Path(__file__).resolve().parents[2] / "docs"
EXE = str(Path(sys.executable).with_name("ckptstore"))


@pytest.fixture
def root(tmp_path: Path) -> str:
    """Steps 1, 2 and 3 committed, 256 KiB each (one leaf of several chunks)."""
    path = str(tmp_path / "run")
    for step in (1, 2, 3):
        w = np.arange(64 << 10, dtype=np.float32) + step
        ckptstore.save_sync(path, {"w": w.reshape(256, 256), "step": step}, step=step)
    return path


def corrupt(root: str, step: int) -> None:
    """Flip one byte in the middle of the step's largest data file."""
    (attempt,) = (Path(root) / str(step)).glob("attempt-*")
    store = attempt / "state" / "ocdbt.process_0"
    victim = max((p for p in store.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 1
    victim.write_bytes(bytes(blob))


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 0) -> Any:
    """Run in-process with --json: exactly one JSON document on stdout, nothing on stderr."""
    assert main([*argv, "--json"]) == status
    captured = capsys.readouterr()
    assert captured.err == "", captured.err  # no progress line, no text error
    return json.loads(captured.out)  # one document: json.loads refuses trailing data


# ---- verify --all ----


def test_verify_all_checks_every_step_and_sums_up(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", root, "--all"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:3]] == ["step 1", "step 2", "step 3"]
    assert all("intact" in line for line in out[:3])
    assert out[3].startswith(f"verified 3 steps in {root}: 3 intact;")
    corrupt(root, 2)
    assert main(["verify", root, "--all"]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT state/w" in out and "step 2: CORRUPT (1 problem)" in out
    assert "state/w: chunk w/c/0/0: checksum (crc32c) mismatch" in out  # leaf and chunk
    assert "step 3: intact" in out  # it goes on after a bad step
    assert "2 intact, 1 CORRUPT (2);" in out
    doc = run_json(["verify", root, "--all"], capsys, status=1)
    assert doc["ok"] is False and [s["step"] for s in doc["steps"]] == [1, 2, 3]
    summary = doc["summary"]
    assert summary["steps"] == 3 and summary["intact"] == 2 and summary["corrupt"] == [2]
    assert summary["unreadable"] == [] and summary["gone"] == []
    assert summary["bytes"] == 2 * ((256 << 10) + 8) + doc["steps"][1]["bytes"]
    assert doc["steps"][1]["problems"] and not doc["steps"][0]["problems"]


def test_verify_all_on_nothing_and_with_step(
    tmp_path: Path, root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty"), "--all"]) == 2
    assert "no committed steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["verify", root, "--all", "--step", "1"])
    assert exited.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_verify_all_as_a_command(root: str) -> None:
    corrupt(root, 3)
    proc = subprocess.run(
        [EXE, "verify", root, "--all", "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ""
    assert json.loads(proc.stdout)["summary"]["corrupt"] == [3]


def test_verify_all_on_a_tiers_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fast, durable = tmp_path / "nvme", tmp_path / "bucket"
    profile = tmp_path / "tiers.toml"
    profile.write_text(f'[tiers]\nfast = "{fast}"\ndurable = "{durable}"\n')
    tiers = ckptstore.Tiered(str(fast), str(durable))
    for step in (1, 2):
        ckptstore.save_sync(tiers, {"x": np.full(64, step)}, step=step)
    ckptstore.promote_sync(tiers, step=1)
    doc = run_json(["verify", str(profile), "--all"], capsys)
    assert doc["ok"] and [s["step"] for s in doc["steps"]] == [1, 2]
    assert {s["tier"] for s in doc["steps"]} == {"fast"}


# ---- --json on every command ----


def test_every_command_answers_one_json_document(
    root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = run_json(["ls", root], capsys)
    assert [r["step"] for r in rows] == [1, 2, 3]
    entries = run_json(["ls", root, "--all"], capsys)
    assert {e["step"] for e in entries} == {1, 2, 3}
    assert run_json(["info", root, "--step", "2"], capsys)["step"] == 2
    assert run_json(["verify", root], capsys)["step"] == 3
    dry = run_json(["rm", root, "--step", "1", "--dry-run"], capsys)
    assert dry["dry_run"] and [s["step"] for s in dry["steps"]] == [1]
    collected = run_json(["gc", root, "--older-than", "0", "--dry-run"], capsys)
    assert collected == {
        "dry_run": True,
        "older_than": 0.0,
        "entries": [],
        "objects": 0,
        "bytes": 0,
        "kept_young": [],
    }

    exported = run_json(["export-orbax", root, str(tmp_path / "orbax"), "--step", "2"], capsys)
    assert exported["step"] == 2 and exported["leaves"] == 2
    assert exported["linked"] + exported["copied"] > 0
    imported = run_json(["import-orbax", str(tmp_path / "orbax"), str(tmp_path / "back")], capsys)
    assert imported["step"] == 0 and imported["leaves"] == 2 and imported["skipped"] == 0
    restored = ckptstore.restore_sync(str(tmp_path / "back"))
    assert restored["w"].tobytes() == ckptstore.restore_sync(root, step=2)["w"].tobytes()

    save_file({"a": np.ones((4, 4), np.float32)}, str(tmp_path / "m.safetensors"))
    st = ["import-safetensors", str(tmp_path / "m.safetensors"), str(tmp_path / "st")]
    done = run_json([*st, "--step", "5"], capsys)
    assert done["step"] == 5 and done["tensors"] == 1 and done["bytes"] == 64

    fast, durable = tmp_path / "nvme", tmp_path / "bucket"
    profile = tmp_path / "tiers.toml"
    profile.write_text(f'[tiers]\nfast = "{fast}"\ndurable = "{durable}"\n')
    ckptstore.save_sync(ckptstore.Tiered(str(fast), str(durable)), {"x": np.ones(8)}, step=4)
    status = run_json(["ls", str(profile)], capsys)
    assert status["steps"] == {"4": "fast"} and status["unpromoted"] == [4]
    promoted = run_json(["promote", str(profile)], capsys)
    assert promoted["durable"] == [4] and promoted["signal"] is None
    (event,) = promoted["steps"]
    assert event["event"] == "promoted" and event["step"] == 4 and event["copied"] > 0
    again = run_json(["promote", str(profile)], capsys)
    assert again["steps"] == [] and again["durable"] == [4]
    assert run_json(["info", str(profile)], capsys)["step"] == 4
    assert run_json(["gc", str(profile), "--dry-run"], capsys)["entries"] == []


def test_promote_watch_json_is_one_document_per_line(tmp_path: Path) -> None:
    fast, durable = tmp_path / "nvme", tmp_path / "bucket"
    profile = tmp_path / "tiers.toml"
    profile.write_text(f'[tiers]\nfast = "{fast}"\ndurable = "{durable}"\n')
    proc = subprocess.Popen(
        [EXE, "promote", str(profile), "--watch", "--interval", "0.1", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["event"] == "watching" and first["durable"] == durable.as_uri()
        ckptstore.save_sync(str(fast), {"x": np.arange(6)}, step=3)
        # The signal goes once the watcher has said it promoted step 3: the step being on
        # the durable tier is not enough (the commit lands before the line is written, and
        # a signal between them interrupts the promotion's report, as it should).
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True)
        reader.start()
        promoted = lines.get(timeout=60)
        assert ckptstore.list_steps_sync(str(durable)) == [3]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and err == ""
    events = [json.loads(line) for line in [promoted, *out.splitlines()]]  # one document each
    assert [e["event"] for e in events] == ["promoted", "stopped"]
    assert events[0]["step"] == 3 and events[0]["copied"] > 0
    assert events[1] == {"event": "stopped", "durable": [3], "signal": "SIGTERM"}


def test_errors_are_json_documents_too(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(["info", root, "--step", "8"], capsys, status=2)
    assert doc["error"]["type"] == "CheckpointNotFoundError" and doc["error"]["exit"] == 2
    assert "step 8 is not committed" in doc["error"]["message"]
    doc = run_json(["ls", "ftp://nowhere"], capsys, status=2)
    assert doc["error"]["type"] == "InvalidURLError"
    for usage in (["verify", root, "--step", "x"], ["frobnicate"], ["rm", root]):
        with pytest.raises(SystemExit) as exited:
            main([*usage, "--json"])
        assert exited.value.code == 2
        captured = capsys.readouterr()
        error = json.loads(captured.out)["error"]
        assert error["type"] == "UsageError" and error["exit"] == 2 and captured.err == ""
    with pytest.raises(SystemExit):  # without --json, argparse's usage text as before
        main(["verify", root, "--step", "x"])
    assert capsys.readouterr().out == ""


def test_verify_names_the_damaged_chunk_of_a_leaf_of_many(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "many")
    w = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)  # 512 KiB
    ckptstore.save_sync(path, {"w": w}, step=1, chunk_bytes=64 << 10)  # 8 chunks
    corrupt(path, 1)
    doc = run_json(["verify", path], capsys, status=1)
    problem = doc["problems"]["state/w"]
    assert re.search(r"^chunk w/c/\d+/\d+: checksum \(crc32c\) mismatch", problem), problem


def test_promote_of_what_is_not_a_tiers_profile_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    for target, said in [
        (str(folder), f"profile {folder} is a directory, not a .toml file"),
        ("s3://bucket/run", "s3://bucket/run is a URL: two tiers come from a .toml profile"),
    ]:
        doc = run_json(["promote", target], capsys, status=2)
        assert doc["error"]["type"] == "ConfigError" and said in doc["error"]["message"]
        assert main(["promote", target]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "Traceback" not in err
    main_help = subprocess.run(
        [EXE, "promote", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    assert "PROFILE" in main_help.split("positional arguments")[1]


def test_json_errors_as_a_command(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    proc = subprocess.run(
        [EXE, "verify", missing, "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stderr == ""
    assert json.loads(proc.stdout)["error"]["type"] == "NotFoundError"


# ---- the progress line ----

VERIFY_SCRIPT = """
import sys
import threading
from ckptstore.cli import main, output
output.PROGRESS_AFTER = float(sys.argv[1])
sys.exit(main(sys.argv[2:]))
"""


def run_on_a_terminal(args: list[str], after: float = 0.0) -> tuple[int, str, str]:
    """Run the command with stderr on a pseudo-terminal (stdout a pipe), the progress line's
    delay set to ``after`` seconds; (status, stdout, what the terminal showed)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", VERIFY_SCRIPT, str(after), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
    )
    os.close(follower)
    shown = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out, shown.decode()


LINE = re.compile(r"verify step 2  [\d.]+ KiB/[\d.]+ KiB \(\d+%\)  [\d.]+ \w+/s  .* left ")


def test_progress_line_on_a_terminal(root: str) -> None:
    status, out, shown = run_on_a_terminal(["verify", root, "--step", "2"])
    assert status == 0 and "step 2: intact" in out
    assert LINE.search(shown), shown
    assert "(100%)" in shown and shown.endswith("\r\n")  # ended: the shell prompt is clean
    # --json, --no-progress: never; short work at the real delay (2 s): nothing either
    for extra, after in (["--json"], 0.0), (["--no-progress"], 0.0), ([], 2.0):
        status, out, shown = run_on_a_terminal(["verify", root, "--step", "2", *extra], after)
        assert status == 0 and shown == "", (extra, shown)
    status, out, shown = run_on_a_terminal(["verify", root, "--all"])
    assert status == 0 and "verify 3 steps  " in shown and "verified 3 steps" in out


def test_no_progress_line_when_stderr_is_not_a_terminal(root: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", VERIFY_SCRIPT, "0", "verify", root],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == ""
    forced = subprocess.run(
        [sys.executable, "-c", VERIFY_SCRIPT, "2", "verify", root, "--progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert forced.returncode == 0 and "verify  " in forced.stderr and "(100%)" in forced.stderr


def test_output_settings_follow_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from argparse import Namespace

    monkeypatch.setattr(cli_output, "stderr_is_terminal", lambda: True)
    assert cli_output.Output.from_args(Namespace()) == cli_output.Output(False, True, 2.0)
    assert not cli_output.Output.from_args(Namespace(json=True)).progress
    assert not cli_output.Output.from_args(Namespace(no_progress=True)).progress
    monkeypatch.setattr(cli_output, "stderr_is_terminal", lambda: False)
    assert not cli_output.Output.from_args(Namespace()).progress
    forced = cli_output.Output.from_args(Namespace(progress=True))
    assert forced.progress and forced.after == 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_waits_its_delay_then_shows_rate_and_time_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    stream = io.StringIO()
    bar = Progress(None, 0, stream=stream, label="verify", after=2.0)
    clock.now += 1.0
    bar.update(10 << 20, 100 << 20)
    assert stream.getvalue() == ""  # under 2 s: nothing
    clock.now += 1.5
    bar.update(25 << 20, 100 << 20)
    line = stream.getvalue()
    assert line.startswith("\rverify  25.0 MiB/100.0 MiB (25%)  10.0 MiB/s")
    assert "elapsed 0:00:02  left 0:00:07" in line
    bar.clear()
    assert stream.getvalue().endswith("\r" + " " * 100 + "\r")
    bar.close()
    assert stream.getvalue().endswith("\n")
    quiet = io.StringIO()
    short = Progress(None, 0, stream=quiet, after=2.0)
    short.update(1, 1)
    short.close()
    assert quiet.getvalue() == ""  # quick work leaves no trace


def test_rm_progress_counts_steps(root: str) -> None:
    """rm cannot know the bytes ahead: its line counts steps, with the bytes removed so far."""
    proc = subprocess.run(
        [EXE, "rm", root, "--step", "1-2", "--progress"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "removed 2 steps (1-2)" in proc.stdout
    final = proc.stderr.splitlines()[-1]  # text mode reads each "\r" as a line end
    assert re.match(r"rm 2/2  5\d\d\.\d KiB \(100%\)  .*/s  elapsed 0:00:0\d  left 0:00:00", final)


# ---- exit statuses, as documented ----


def test_exit_statuses_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    doc = (DOCS / "cli.md").read_text()
    table = dict(re.findall(r"^\| `(\d+)` \| (.+?) \|$", doc, re.M))
    assert set(map(int, table)) == set(EXIT_STATUSES) == {0, 1, 2, 3}
    for code, text in EXIT_STATUSES.items():
        assert f"  {code}  {text.split()[0]}" in help_text
        assert table[str(code)].split()[0].strip(":,") == text.split()[0].strip(":,")
    assert "128+N" in help_text and "128 + N" in doc


def test_exit_statuses_as_a_command(root: str, tmp_path: Path) -> None:
    """0 intact, 1 corrupt, 2 an error (a step that is not committed, bad usage); 3 (the
    storage failed) is asserted against a failing server in
    tests/campaigns/test_datapath_faults.py."""

    def status(*args: str) -> int:
        return subprocess.run([EXE, *args], capture_output=True, timeout=120).returncode

    assert status("verify", root) == 0
    assert status("info", root, "--step", "9") == 2
    assert status("verify", root, "--step", "nine") == 2
    corrupt(root, 1)
    assert status("verify", root, "--step", "1") == 1
    assert status("verify", root, "--all") == 1


class _LateSignal:
    """A signal that came as the promotion ended: the promotion ran to its end, and the
    command learns of the signal before it reports (`Signals.run` returns None)."""

    async def run(self, coro: Any) -> None:
        await coro


async def test_a_promotion_whose_signal_came_after_its_marker_says_it_is_durable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptstore.cli.tiers import _promote_one, _Say
    from ckptstore.tiers.target import Tiered

    await ckptstore.save(str(tmp_path / "nvme"), {"x": np.arange(6)}, step=3)
    tiered = Tiered(fast=str(tmp_path / "nvme"), durable=str(tmp_path / "bucket"))
    async with tiered.opened() as (fast, durable):
        tiers = Tiered(fast=fast, durable=durable)
        say = _Say(as_json=True, watch=False)
        went_on = await _promote_one(
            tiers,
            3,
            cli_output.Output(json=True),
            say,
            _LateSignal(),
            skip_gone=True,  # type: ignore[arg-type]
        )
    assert not went_on
    assert say.events == [{"event": "interrupted", "step": 3, "durable": True}]
    assert await ckptstore.list_steps(str(tmp_path / "bucket")) == [3]
