"""The hostile inputs of tests/campaigns/test_hostile.py, and the count of those other files cover.

Each table maps a case id (the test id) to what is done to a good store and the message
the typed error must carry. `ELSEWHERE` lists the hostile-input cases other test files
cover; tests/campaigns/test_hostile.py checks each entry against that file's parametrization and
prints the total that docs/reliability.md gives.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

Doc = dict[str, Any]


def leaf(doc: Doc, name: str = "x") -> Doc:
    """The record of leaf ``name`` of item "state" in a manifest or part record."""
    leaves: Doc = doc["items"]["state"]["leaves"] if "items" in doc else doc["leaves"]
    return leaves[name]  # type: ignore[no-any-return]


def rename_leaf(doc: Doc, old: str, new: str) -> None:
    """Rename a leaf in the leaf table and in the structure, as a forger would."""
    item = doc["items"]["state"] if "items" in doc else doc
    item["leaves"][new] = item["leaves"].pop(old)

    def walk(node: Doc) -> None:
        if node.get("t") == "leaf" and node.get("name") == old:
            node["name"] = new
        for child in node.get("items", []):
            walk(child)

    walk(item["structure"])


DEEP = "[" * 100_000 + "]" * 100_000  # JSON deep enough to exhaust a recursive parser

#: Edits of step 2's manifest (re-signed, so only the reader's own checks can catch them):
#: id -> (edit, text the `CorruptCheckpointError` must contain). An edit returning bytes
#: replaces the whole manifest.
MANIFESTS: dict[str, tuple[Callable[[Doc], Any], str]] = {
    "negative dim": (lambda d: leaf(d).update(shape=[-4]), "bad shape"),
    "rank 65": (lambda d: leaf(d).update(shape=[1] * 65, chunk_shape=[1] * 65), "bad shape"),
    "chunk rank differs": (lambda d: leaf(d).update(chunk_shape=[]), "bad chunk shape"),
    "zero chunk": (lambda d: leaf(d).update(chunk_shape=[0]), "bad chunk shape"),
    "shape a string": (lambda d: leaf(d).update(shape="4"), "bad shape"),
    "bool dim": (lambda d: leaf(d).update(shape=[True]), "bad shape"),
    "float dim": (lambda d: leaf(d).update(shape=[4.0]), "bad shape"),
    "chunk beyond shape": (lambda d: leaf(d).update(chunk_shape=[2**62]), "bad chunk shape"),
    "NaN step": (lambda d: d.update(step=float("nan")), "bad step"),
    "negative step": (lambda d: d.update(step=-1), "bad step"),
    "bool step": (lambda d: d.update(step=True), "bad step"),
    "step a string": (lambda d: d.update(step="2"), "bad step"),
    "float step": (lambda d: d.update(step=2.0), "bad step"),
    "items a list": (lambda d: d.update(items=[]), "no items"),
    "no items": (lambda d: d.update(items={}), "no items"),
    "leaves a list": (lambda d: d["items"]["state"].update(leaves=[]), "leaves is not an object"),
    "dtype object": (lambda d: leaf(d).update(dtype="object"), "dtype 'object'"),
    "dtype <U8": (lambda d: leaf(d).update(dtype="<U8"), "dtype '<U8'"),
    "dtype empty": (lambda d: leaf(d).update(dtype=""), "dtype ''"),
    "dtype a number": (lambda d: leaf(d).update(dtype=4), "bad dtype"),
    "dtype not stored": (lambda d: leaf(d).update(dtype="int64"), "data_type"),
    "kind unknown": (lambda d: leaf(d).update(kind="pickle"), "bad kind"),
    "not ours": (lambda d: d.update(format="orbax"), "not a ckptstore manifest"),
    "format version 99": (lambda d: d.update(format_version=99), "newer than this"),
    "timings not numbers": (lambda d: d.update(timings={"write": "fast"}), "timings"),
    "created infinite": (lambda d: d.update(created=float("inf")), "creation time"),
    "sharding a list": (lambda d: leaf(d).update(sharding=[1]), "bad sharding"),
    "number with a shape": (lambda d: leaf(d).update(python_type="int"), "Python number"),
    "reserved item name": (
        lambda d: d["items"].update(COMMITTED=d["items"].pop("state")),
        "item name",
    ),
    "parts escape": (lambda d: d["items"]["state"].update(parts=["../../../../etc"]), "'..'"),
    "parts absolute": (lambda d: d["items"]["state"].update(parts=["/etc"]), "/etc"),
    "parts not strings": (lambda d: d["items"]["state"].update(parts=[1]), "bad parts"),
    "metadata a list": (lambda d: d.update(metadata=[]), "metadata"),
    "references escape": (
        lambda d: d.update(references=[{"step": "../x", "attempt": "../../etc"}]),
        "bad reference",
    ),
    "leaf name escapes": (lambda d: rename_leaf(d, "x", "../../../../up"), "bad leaf name"),
    "leaf name absolute": (lambda d: rename_leaf(d, "x", "/etc/passwd"), "bad leaf name"),
    "leaf name with NUL": (lambda d: rename_leaf(d, "x", "a\x00b"), "bad leaf name"),
    "leaf name empty": (lambda d: rename_leaf(d, "x", ""), "leaf name"),
    "JSON array": (lambda d: b"[]", "not a JSON object"),
    "deep JSON": (lambda d: f'{{"metadata": {DEEP}}}'.encode(), "recursion"),
    "not UTF-8": (lambda d: b'{"format": "\xff\xfe"}', "manifest"),
    "empty file": (lambda d: b"", "manifest"),
}

#: Step 2's commit marker replaced: id -> (bytes, text the error must contain).
MARKERS: dict[str, tuple[bytes, str]] = {
    "format version 99": (
        b'{"format": "ckptstore", "format_version": 99, "step": 2, "attempt": '
        b'"attempt-20260101T000000-000000000000", "manifest_digest": "sha256:' + b"0" * 64 + b'"}',
        "newer than this",
    ),
    "names step 3": (b'{"step": 3}', "names step 3"),
    "digest malformed": (
        b'{"format": "ckptstore", "format_version": 2, "step": 2, "attempt": '
        b'"attempt-20260101T000000-000000000000", "manifest_digest": "md5:x"}',
        "bad manifest digest",
    ),
    "names no attempt": (
        b'{"format": "ckptstore", "format_version": 2, "step": 2, "attempt": '
        b'"attempt-20260101T000000-000000000000", "manifest_digest": "sha256:' + b"0" * 64 + b'"}',
        "manifest .* is missing",
    ),
    "deep JSON": (DEEP.encode(), "recursion"),
    "not UTF-8": (b"\xff\xfe\x00", "commit marker"),
}

#: Part 1 of an unfinished partial save of step 3, hand-edited: id -> (edit, text).
PART_RECORDS: dict[str, tuple[Callable[[Doc], Any], str]] = {
    "negative shape": (lambda d: leaf(d, "b").update(shape=[-2]), "bad shape"),
    "dtype object": (lambda d: leaf(d, "b").update(dtype="object"), "dtype 'object'"),
    "dir escapes": (lambda d: d.update(dir="../../../../x"), "names directory"),
    "index mismatch": (lambda d: d.update(index=7), "part 7 names directory"),
    "index a bool": (lambda d: d.update(index=True), "part True"),
    "not JSON": (lambda d: b"{nope", "unreadable part record"),
    "leaves a list": (lambda d: d.update(leaves=[]), "unreadable part record"),
    "forged processes": (lambda d: d.update(processes=[{}] * 1000), "processes"),
    "structure malformed": (lambda d: d.update(structure={"t": "evil"}), "malformed node"),
    "structure names others": (
        lambda d: d.update(
            structure={"t": "dict", "keys": [["str", "c"]], "items": [{"t": "leaf", "name": "c"}]}
        ),
        "different leaves",
    ),
    "leaf name escapes": (lambda d: rename_leaf(d, "b", "../../b"), "bad leaf name"),
    "deep JSON": (lambda d: DEEP.encode(), "recursion"),
}

#: Profiles (TOML): id -> (file content, text the `ConfigError`/`InvalidURLError` must carry).
PROFILES: dict[str, tuple[bytes, str]] = {
    "not UTF-8": (b'url = "/tmp/x\xff"\n', "not valid TOML"),
    "nested too deeply": (b'url = "/x"\nx = ' + DEEP.encode() + b"\n", "nested too deeply"),
    "endpoint a number": (b'url = "s3://b/p"\n[options]\nendpoint = 5\n', "'endpoint' must be"),
    "region a list": (b'url = "s3://b/p"\n[options]\nregion = [1]\n', "'region' must be"),
    "fsync a string": (b'url = "/x"\n[options]\nfsync = "yes"\n', "'fsync' must be a bool"),
    "url with NUL": (b'url = "/tmp/x\\u0000y"\n', "NUL"),
    "options not a table": (b'url = "/x"\noptions = 3\n', "must be a table"),
    "tiers without durable": (b'[tiers]\nfast = "/tmp/f"\n', "fast and durable"),
    "tiers not a table": (b"tiers = 5\n", "is a table"),
    "retry attempts a string": (
        b'url = "/x"\n[options.retry]\nmax_attempts = "many"\n',
        r"\[options.retry\] max_attempts must be an integer",
    ),
    "retry delay infinite": (
        b'url = "/x"\n[options.retry]\nmax_delay = inf\n',
        r"\[options.retry\] max_delay must be a finite number",
    ),
    "retry a string": (b'url = "/x"\n[options]\nretry = "many"\n', "'retry' must be"),
    "timeout infinite": (
        b'url = "s3://b/p"\n[options]\nread_timeout = inf\n',
        "read_timeout must be a finite number",
    ),
    "keep_fast a string": (
        b'[tiers]\nfast = "/tmp/f"\ndurable = "/tmp/d"\nkeep_fast = "2"\n',
        "keep_fast must be a number of steps",
    ),
    "empty": (b"", "is required"),
}


def safetensors(header: bytes, data: bytes = bytes(64), length: int | None = None) -> bytes:
    """A safetensors file with this header (and, if given, this declared header length)."""
    return struct.pack("<Q", len(header) if length is None else length) + header + data


#: Safetensors files beyond tests/importers/test_import_safetensors.py's headers:
#: id -> (bytes, text).
SAFETENSORS: dict[str, tuple[bytes, str]] = {
    "header length beyond file": (safetensors(b"{}", length=1000), "impossible"),
    "header length 2**64-1": (safetensors(b"{}", length=2**64 - 1), "impossible"),
    "shorter than 8 bytes": (b"\x02\x00", "too short"),
    "header a list": (safetensors(b"[]"), "not a JSON object"),
    "header not UTF-8": (safetensors(b'{"\xff": 1}'), "not JSON"),
    "entry not an object": (safetensors(b'{"a": 5}'), "bad header entry"),
    "offsets beyond data": (
        safetensors(b'{"a": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}}'),
        "inconsistent",
    ),
    "end before start": (
        safetensors(b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}'),
        "inconsistent",
    ),
}

#: Step directory names that are not steps (each holds a copy of step 1, marker included).
STEP_NAMES = ["05", "-1", "1.0", " 1", "1 ", "+1", "0x1", "\u0967", "\u0661", "1\u0301"]

#: Hostile-input cases other test files cover: (module, test, kind, cases, parameter), the
#: module a test file's name (in whichever folder below tests/) unless dotted. A
#: parametrized test's count is checked against its parameter's values.
ELSEWHERE: list[tuple[str, str, str, int, str | None]] = [
    ("test_commit", "test_hostile_manifests_are_corrupt_not_tracebacks", "manifest", 6, "edit"),
    ("test_commit", "test_manifest_edited_to_another_step_is_caught", "manifest", 2, None),
    ("test_commit", "test_marker_naming_another_steps_attempt_is_caught", "marker", 2, None),
    ("test_commit", "test_unreadable_marker_is_corrupt_not_missing", "marker", 4, "marker"),
    ("test_commit", "test_v1_tampering_is_still_caught", "manifest", 1, None),
    ("test_commit", "test_steps_with_odd_names_are_not_listed", "step name", 4, None),
    ("test_integrity", "test_corrupt_manifest_is_reported", "manifest", 1, None),
    (
        "test_import_safetensors",
        "test_hostile_headers_are_refused_by_name",
        "safetensors",
        10,
        "header, why",
    ),
    ("test_orbax_in", "test_hand_edited_metadata_is_a_typed_error", "Orbax metadata", 0, "damage"),
    ("test_orbax_in", "test_string_leaves_are_refused_by_name", "Orbax metadata", 1, None),
    (
        "test_orbax_hostile",
        "test_a_huge_sequence_index_is_a_typed_error",
        "Orbax metadata",
        0,
        "index",
    ),
    ("test_orbax_hostile", "test_info_flags_an_impossible_size", "Orbax size", 0, "case"),
    (
        "test_orbax_hostile",
        "test_an_edited_zarray_is_corrupt_not_different_data",
        "Orbax metadata",
        0,
        "edit",
    ),
    (
        "test_orbax_hostile",
        "test_declared_sizes_beyond_the_stored_bytes_never_abort",
        "Orbax size",
        10,
        None,
    ),
    ("test_registry", "test_bad_urls", "URL", 6, "url"),
    ("test_registry", "test_secret_in_url_never_echoed", "URL", 1, None),
    ("test_registry", "test_memory_urls_need_a_name", "URL", 1, None),
    ("test_registry", "test_bad_profiles", "profile", 5, "text, match"),
    ("test_registry", "test_missing_profile", "profile", 1, None),
    ("test_registry", "test_unknown_option_names_it", "profile", 1, None),
    ("test_registry", "test_bad_concurrency_is_refused_not_a_hang", "profile", 4, "concurrency"),
    (
        "test_registry",
        "test_a_secret_passed_as_credentials_is_not_echoed",
        "profile",
        2,
        "url, secret",
    ),
    ("test_check_root", "test_a_missing_or_non_directory_local_root", "root", 2, None),
    ("test_check_root", "test_a_missing_s3_bucket", "root", 1, None),
    ("test_check_root", "test_a_missing_gcs_bucket", "root", 1, None),
    (
        "ckptstore.testing.conformance",
        "BackendTests.test_invalid_keys_rejected_before_io",
        "key",
        9,
        "key",
    ),
    ("test_partial", "test_sessions_resume_start_anew_and_abandon", "session", 2, None),
    (
        "test_registry",
        "test_every_option_of_the_wrong_type_is_named",
        "profile",
        0,
        "kind, field, value",
    ),
    ("test_registry", "test_tiers_fields_of_the_wrong_type_are_named", "profile", 4, "line, match"),
    (
        "test_registry",
        "test_manager_fields_of_the_wrong_type_are_named",
        "profile",
        6,
        "table, match",
    ),
    (
        "test_hostile_trees",
        "test_a_hostile_tree_is_refused_before_anything_is_written",
        "tree",
        14,
        "case",
    ),
    (
        "test_secrets",
        "test_an_endpoint_carrying_a_secret_is_refused_unechoed",
        "endpoint",
        10,
        "endpoint",
    ),
    ("test_secrets", "test_a_target_url_carrying_a_secret_is_refused_unechoed", "URL", 9, "target"),
    (
        "test_secrets",
        "test_a_secret_key_and_token_reaching_a_dead_server_are_not_logged",
        "secret",
        1,
        None,
    ),
    ("test_plain_proxy", "test_a_save_through_a_plain_proxy_lands_whole", "proxy", 2, "protocol"),
    ("test_plain_proxy", "test_a_proxy_that_misreports_sizes_gets_no_commit", "proxy", 1, None),
    ("test_timeouts", "test_the_deadline_bounds_tensorstore_requests_too", "endpoint", 1, None),
]
