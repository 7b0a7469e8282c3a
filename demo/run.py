"""`make demo`: train, get preempted, restart, resume bit-exact, finish; fine-tune adapters
over a frozen base with incremental saves; then the figures.

    python demo/run.py [--s3] [--steps N] [--save-every N] [--preempt-at N] [--adapter-steps N]

Runs demo/train.py (an MLP on scikit-learn's digits, saving asynchronously with a
`ckptstore.CheckpointManager`, keeping the latest 3 plus the best by validation accuracy)
against a temporary local directory, or with ``--s3`` against an embedded moto S3 server.
Once the job passes ``--preempt-at`` it gets SIGTERM, saves that step and exits; a
restarted job resumes from the latest committed step, checks the restored state is
bit-exact, and finishes. Then demo/adapters.py (the adapter phase) saves a LoRA-like state
every step with ``ManagerOptions(incremental=True)`` to the same storage and shows the
bytes each save wrote against the state's size. Exits non-zero if anything did not happen
as it should.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

TRAIN = Path(__file__).with_name("train.py")
ADAPTERS = Path(__file__).with_name("adapters.py")


def run_job(target: str, args: argparse.Namespace, preempt_at: int | None) -> list[dict[str, Any]]:
    """One training job; its events, shown as they come."""
    cmd = [
        sys.executable,
        str(TRAIN),
        target,
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    events = []
    sent = False
    for line in proc.stdout:
        event = json.loads(line)
        events.append(event)
        show(event)
        if preempt_at is not None and not sent and event.get("step", 0) >= preempt_at:
            print(f"  >> sending SIGTERM to the job (pid {proc.pid})", flush=True)
            proc.send_signal(signal.SIGTERM)
            sent = True
    if proc.wait() != 0:
        raise SystemExit(f"the training job failed with exit status {proc.returncode}")
    return events


def show(e: dict[str, Any]) -> None:
    kind = e["event"]
    if kind == "progress":
        print(
            f"  step {e['step']:4d}  loss {e['loss']:.4f}  val_acc {e['val_acc']:.3f}", flush=True
        )
    elif kind == "save":
        print(
            f"  step {e['step']:4d}  saved: loop paused {e['pause'] * 1e3:.1f} ms "
            f"(a plain host copy: {e['host_copy'] * 1e3:.1f} ms)",
            flush=True,
        )
    elif kind in ("preempted", "resumed"):
        print(f"  -- {kind} at step {e['step']}", flush=True)
    elif kind == "done":
        print(
            f"  -- finished at step {e['step']}: val_acc {e['val_acc']:.3f}, "
            f"steps kept {e['kept']}",
            flush=True,
        )


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:7.1f} ms (max {max(values) * 1e3:.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--s3", action="store_true", help="save to an embedded moto S3 server")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--preempt-at", type=int, help="default: 40%% of the steps")
    parser.add_argument("--adapter-steps", type=int, default=5, help="saves of the adapter phase")
    args = parser.parse_args()
    preempt_at = args.preempt_at or int(args.steps * 0.4) + 3

    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptstore-demo-")))
        if args.s3:
            from ckptstore.testing.servers import MOTO_KEY, MotoS3Server

            server = stack.enter_context(MotoS3Server())
            bucket = server.create_bucket()
            target = str(tmp / "demo.toml")
            Path(target).write_text(
                f'url = "s3://{bucket}/demo"\n[options]\nendpoint = "{server.endpoint}"\n'
                'credentials = "env"\n'
            )
            os.environ.setdefault("AWS_ACCESS_KEY_ID", MOTO_KEY)
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", MOTO_KEY)
            where = f"s3://{bucket}/demo on moto at {server.endpoint}"
            adapters = str(tmp / "adapters.toml")
            Path(adapters).write_text(
                Path(target).read_text().replace(f"s3://{bucket}/demo", f"s3://{bucket}/adapters")
            )
        else:
            target = str(tmp / "run")
            where = target
            adapters = str(tmp / "adapters")
        print(f"ckptstore demo: {args.steps} steps, saving every {args.save_every} to {where}")
        print(f"run 1 (will be preempted after step {preempt_at}):", flush=True)
        first = run_job(target, args, preempt_at)
        print("run 2 (restarted):", flush=True)
        second = run_job(target, args, None)
        print("adapter phase (LoRA fine-tuning over a frozen base):", flush=True)
        cmd = [sys.executable, str(ADAPTERS), adapters, "--steps", str(args.adapter_steps)]
        adapter_ok = subprocess.run(cmd).returncode == 0

    preempted = [e for e in first if e["event"] == "preempted"]
    resumed = [e for e in second if e["event"] == "resumed"]
    saved_digest = {e["step"]: e["digest"] for e in first if "digest" in e}
    done = [e for e in second if e["event"] == "done"]
    saves = [e for e in first + second if e["event"] == "save"]
    durable = [e["durable"] for e in first + second if e["event"] == "durable"]
    staging = [e["staging"] for e in first + second if e["event"] == "durable"]
    waited = [e["waited"] for e in first + second if e["event"] == "durable"]
    problems = []
    if not preempted:
        problems.append("the first run was not preempted")
    elif not resumed or resumed[0]["step"] != preempted[0]["step"]:
        problems.append("the second run did not resume from the preempted step")
    elif saved_digest.get(resumed[0]["step"]) != resumed[0]["digest"]:
        problems.append("the restored state differs from the saved one")
    if not done or done[0]["step"] != args.steps:
        problems.append("the second run did not finish")
    if not adapter_ok:
        problems.append("the adapter phase failed")

    print()
    print(f"{'saves':34} {len(saves)}")
    print(f"{'loop paused per save':34} {ms([e['pause'] for e in saves])}")
    print(f"{'  of which staging (host copy)':34} {ms(staging)}")
    print(f"{'  of which waiting for the last one':34} {ms(waited)}")
    print(f"{'a plain host copy of the state':34} {ms([e['host_copy'] for e in saves])}")
    print(f"{'save() to durable (committed)':34} {ms(durable)}")
    if preempted and resumed:
        ok = saved_digest.get(resumed[0]["step"]) == resumed[0]["digest"]
        print(
            f"{'preempted at / resumed from':34} step {preempted[0]['step']} / step "
            f"{resumed[0]['step']} ({'bit-exact' if ok else 'DIFFERENT'})"
        )
    if done:
        print(f"{'steps kept':34} {done[0]['kept']} (latest 3 + best val_acc)")
        print(f"{'final validation accuracy':34} {done[0]['val_acc']:.3f}")
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
