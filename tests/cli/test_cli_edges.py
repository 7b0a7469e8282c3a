"""The ckptstore command's edges: help, version, missing targets, closed pipes, grammar,
--profile and --endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.cli import SIGPIPE_EXIT, main
from ckptstore.testing.servers import FakeGcsServer, MotoS3Server

EXE = str(Path(sys.executable).with_name("ckptstore"))


@pytest.fixture
def saved(tmp_path: Path) -> str:
    path = str(tmp_path / "ckpt")
    ckptstore.save_sync(path, {"a": np.arange(4), "b": np.ones(3)}, step=5)
    return path


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_is_plain_text_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_text(["--help"], capsys)
    assert "examples:" in out and "ckptstore ls s3://bucket/run --all" in out
    assert "exit status:" in out and "--profile" in out and "--endpoint" in out
    commands = ["ls", "info", "verify", "rm", "gc", "promote", "import-safetensors"]
    for text in [out, *(help_text([c, "--help"], capsys) for c in commands)]:
        assert "``" not in text and ":class:" not in text and "`" not in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert help_text(["--version"], capsys).strip() == f"ckptstore {version('ckptstore')}"


@pytest.mark.parametrize("command", [["ls"], ["ls", "--all"], ["info"], ["verify"], ["gc"]])
def test_a_missing_directory_is_an_error(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nothing"
    assert main([*command, str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"ckptstore: error: no such directory {missing}\n"
    assert not missing.exists()


def test_an_empty_directory_has_no_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"no committed checkpoints in {tmp_path}\n"
    assert main(["info", str(tmp_path)]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err


def test_a_mistyped_url_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["ls", "s3:/bucket/run"]) == 2
    assert "(a URL is written scheme://bucket/prefix)" in capsys.readouterr().err
    assert main(["ls", "ftp://nowhere"]) == 2
    assert "unknown scheme 'ftp'" in capsys.readouterr().err


def test_object_stores_missing_bucket_or_empty_prefix(
    ckptstore_s3_server: MotoS3Server,
    ckptstore_s3_bucket: str,
    ckptstore_gcs_server: FakeGcsServer,
    ckptstore_gcs_bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for scheme, server, bucket in [
        ("s3", ckptstore_s3_server, ckptstore_s3_bucket),
        ("gs", ckptstore_gcs_server, ckptstore_gcs_bucket),
    ]:
        endpoint = ["--endpoint", server.endpoint]
        assert main([*endpoint, "ls", f"{scheme}://{bucket}/no/such/prefix"]) == 0
        assert "no committed checkpoints" in capsys.readouterr().out
        for command in ("ls", "info", "verify"):
            assert main([*endpoint, command, f"{scheme}://missing-bucket-x/run"]) == 2
            err = capsys.readouterr().err
            assert f"bucket 'missing-bucket-x' does not exist at {server.endpoint}" in err


def test_endpoint_reaches_the_server_for_arrays_too(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{ckptstore_s3_bucket}/run"
    ckptstore.save_sync(
        ckptstore.open_backend(url, endpoint=ckptstore_s3_server.endpoint),
        {"x": np.arange(5)},
        step=3,
    )
    assert main(["--endpoint", ckptstore_s3_server.endpoint, "verify", url]) == 0
    assert "step 3: intact; 1 leaf" in capsys.readouterr().out
    assert (
        main(["info", url, "--endpoint", ckptstore_s3_server.endpoint]) == 0
    )  # after the command too
    assert "step 3" in capsys.readouterr().out
    assert main(["--endpoint", "http://127.0.0.1:1", "ls", "/tmp"]) == 2
    assert "unknown option(s) ['endpoint'] for a local backend" in capsys.readouterr().err


def test_closed_pipe_ends_quietly(saved: str) -> None:
    """``ckptstore info X | head``: the reader is gone before the command writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [EXE, "info", saved], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == SIGPIPE_EXIT


def test_closed_pipe_mid_output(tmp_path: Path) -> None:
    """More output than a pipe holds, and a reader that takes one line and leaves."""
    path = str(tmp_path / "wide")
    ckptstore.save_sync(
        path, {f"leaf_{i:04d}_" + "x" * 200: np.zeros(1) for i in range(400)}, step=1
    )
    proc = subprocess.Popen(
        [EXE, "info", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith("step 1")
    proc.stdout.close()
    assert proc.wait(timeout=120) == SIGPIPE_EXIT
    assert proc.stderr.read() == ""


def test_info_one_line_per_process_with_parts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "model.safetensors"
    save_file({f"t{i}": np.full((256, 256), i, np.float32) for i in range(3)}, str(src))
    dst = str(tmp_path / "ckpt")
    argv = ["import-safetensors", str(src), dst, "--batch-mib", "0", "--no-progress"]
    assert main(argv) == 0
    assert "imported 3 tensors (768.0 KiB) in 3 parts as step 0" in capsys.readouterr().out
    assert main(["info", dst]) == 0
    processes = [line for line in capsys.readouterr().out.splitlines() if "process 0:" in line]
    assert len(processes) == 1
    assert "wrote 768.0 KiB in 3 shards (3 parts)" in processes[0]


def test_profile_by_name_before_or_after_the_command(
    saved: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "mine.toml").write_text('url = "../ckpt"\n')  # relative to the profile's folder
    monkeypatch.setenv("CKPTSTORE_PROFILES_DIR", str(profiles))
    monkeypatch.chdir("/")
    for argv in (["--profile", "mine", "ls"], ["ls", "--profile", "mine"]):
        assert main(argv) == 0
        assert capsys.readouterr().out.splitlines()[1].split()[0] == "5"
    monkeypatch.setenv("CKPTSTORE_PROFILE", "mine")
    assert main(["info"]) == 0
    assert "step 5" in capsys.readouterr().out
    assert main(["--profile", "other", "ls"]) == 2
    assert "no profile named 'other'" in capsys.readouterr().err


def test_a_tiers_profile_by_name_lists_both_tiers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "tiers.toml").write_text('[tiers]\nfast = "../nvme"\ndurable = "../bucket"\n')
    ckptstore.save_sync(str(tmp_path / "nvme"), {"x": np.arange(2)}, step=4)
    monkeypatch.setenv("CKPTSTORE_PROFILES_DIR", str(profiles))
    monkeypatch.chdir("/")
    assert main(["--profile", "tiers", "ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "4" and "not promoted yet" in lines[1]
    assert main(["--profile", "tiers", "--endpoint", "http://127.0.0.1:1", "ls"]) == 2
    assert "--endpoint does not apply to the tiers of" in capsys.readouterr().err
    assert main(["ls", "tiers", "--all"]) == 0  # each tier's entries (was refused)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fast tier, ") and out[1].split()[:3] == ["STEP", "STATE", "STORED"]
    assert out[2].split()[:2] == ["4", "committed"]
    assert out[3].startswith("durable tier, ") and out[4].startswith("nothing stored in")


async def test_rm_of_a_step_another_process_deleted_meanwhile_succeeds_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ckptstore rm --step 1-2` lists steps 1 and 2; another process deletes step 1
    before this one reads its marker: the goal holds, so rm exits 0 and says so."""
    from ckptstore.backends.local import LocalBackend
    from ckptstore.cli.output import Output
    from ckptstore.cli.remove import StepSpec, cmd_rm
    from tests.lifecycle.helpers import _DeletedFirst

    backend = _DeletedFirst(LocalBackend(tmp_path / "run"))
    for step in (1, 2, 3):
        await ckptstore.save(backend, {"w": np.zeros(4)}, step=step)
    backend.armed = {1}
    status = await cmd_rm(backend, "run", [StepSpec(1, 2, single=False)], None, False, Output())
    assert status == 0
    out = capsys.readouterr().out
    assert "1 step (1) already removed by another process" in out
    assert "1 committed step remains: 3" in out
    assert await ckptstore.list_steps(backend) == [3]


def test_missing_aws_credentials_are_a_configuration_error(
    ckptstore_s3_server: MotoS3Server,
    ckptstore_s3_bucket: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No credentials in the environment: exit 2 (configuration, what to fix), naming the
    variables to set; not 3 (the storage failed)."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    url = f"s3://{ckptstore_s3_bucket}/run"
    profile = ["--endpoint", ckptstore_s3_server.endpoint]
    assert main([*profile, "ls", url]) == 2
    err = capsys.readouterr().err
    assert "no usable AWS credentials" in err and "AWS_ACCESS_KEY_ID" in err
    backend = ckptstore.open_backend(url, endpoint=ckptstore_s3_server.endpoint, credentials="env")
    with pytest.raises(ckptstore.CredentialsError) as raised:
        ckptstore.list_steps_sync(backend)
    assert isinstance(raised.value, ckptstore.PermissionDeniedError | ckptstore.ConfigError)


def test_nothing_answering_at_the_endpoint_says_where_it_comes_from(
    ckptstore_s3_server: MotoS3Server,  # for its test credentials and region
) -> None:
    from ckptstore.backends.retry import RetryPolicy

    backend = ckptstore.open_backend(
        "s3://bucket/run", endpoint="http://127.0.0.1:1", retry=RetryPolicy(max_attempts=1)
    )
    with pytest.raises(ckptstore.TransientStorageError) as raised:
        ckptstore.list_steps_sync(backend)
    message = str(raised.value)
    assert "nothing answered at http://127.0.0.1:1" in message
    assert "--endpoint" in message and "AWS_ENDPOINT_URL_S3" in message
