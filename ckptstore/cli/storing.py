"""How the ``ckptstore`` commands that write a step store its leaves: ``--codec`` and ``--cast``.

Both flags repeat, in order, and take ``PATTERN=VALUE`` (a glob over leaf names; the first
pattern that matches a leaf decides, as ``save(codecs={...})`` does) or a bare ``VALUE``,
which stands for ``*=VALUE``::

    ckptstore import-orbax run/ /data/ckpt --codec 'opt_state/*=zstd:3' --codec none
    ckptstore import-safetensors model/ /data/ckpt --codec zstd:1 --cast '*/mu=bfloat16'

The values are checked as `ckptstore.save` checks them (`CodecPolicy`, `CastPolicy`): a
bad one is a usage error before anything is read or written.
"""

from __future__ import annotations

import argparse
from typing import Any

from ckptstore.errors import ConfigError
from ckptstore.format.casts import CastPolicy
from ckptstore.format.codecs import CodecPolicy


def add_storing_options(parser: argparse.ArgumentParser) -> None:
    """``--codec`` and ``--cast`` on a command that writes a step."""
    parser.add_argument(
        "--codec",
        action="append",
        default=[],
        metavar="[PATTERN=]CODEC",
        help="compress leaves: none, zstd or zstd:LEVEL, for the leaves PATTERN matches "
        "(default: every leaf); repeat, the first match wins (default: none)",
    )
    parser.add_argument(
        "--cast",
        action="append",
        default=[],
        metavar="PATTERN=DTYPE",
        help="store the leaves PATTERN matches narrower (bfloat16, float16, float8_*); "
        "lossy, restored into their own dtype; repeat, the first match wins",
    )


def storing_options(args: argparse.Namespace) -> dict[str, Any]:
    """``{"codecs": CodecPolicy, "casts": CastPolicy}`` from the flags; `ConfigError`
    naming the flag and value that is wrong."""
    return {
        "codecs": CodecPolicy.of(_rules(args.codec, "--codec"), what="--codec"),
        "casts": CastPolicy.of(_rules(args.cast, "--cast"), what="--cast"),
    }


def _rules(values: list[str], flag: str) -> dict[str, str] | None:
    """``PATTERN=VALUE`` flags as an ordered ``{pattern: value}`` (a bare value is ``*``)."""
    if not values:
        return None
    rules: dict[str, str] = {}
    for text in values:
        pattern, sep, value = text.rpartition("=")
        if not sep:
            pattern = "*"
        if not pattern or not value:
            raise ConfigError(f"{flag} {text!r}: expected PATTERN=VALUE or VALUE")
        if pattern in rules:
            raise ConfigError(f"{flag}: the pattern {pattern!r} is given twice")
        rules[pattern] = value
    return rules
