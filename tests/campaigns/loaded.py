"""The test suite beside busy CPU loops (`make test-loaded`): what a shared machine does to
a suite's timing assumptions. Starts ``--loops`` processes that spin, runs pytest with the
remaining arguments, stops the loops, and exits with pytest's status."""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time


def spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=2, help="busy processes beside the suite")
    args, pytest_args = parser.parse_known_args(argv)
    loops = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.loops)]
    for loop in loops:
        loop.start()
    start = time.monotonic()
    try:
        status = subprocess.call([sys.executable, "-m", "pytest", "-q", *pytest_args])
    finally:
        for loop in loops:
            loop.kill()
    print(
        f"loaded run ({args.loops} busy loops): exit {status} in {time.monotonic() - start:.0f} s"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
