"""Grammar of namespaces, checkpoint ids and file names (names become path components)."""

from __future__ import annotations

import pytest
from tierckpt.errors import InvalidName, TierckptError
from tierckpt.names import (
    METADATA_FILE,
    check_checkpoint_id,
    check_file_name,
    check_namespace,
    check_new_checkpoint_id,
    checkpoint_id_of_flat,
    flat_checkpoint_id,
    step_of,
)

CHECKERS = {
    "namespace": check_namespace,
    "checkpoint id": check_checkpoint_id,
    "file name": check_file_name,
}

VALID = ["a", "step-000100", "llama3-70b_run.7", "A.b_c-9", "x" * 128, "...", ".hidden", "0"]
INVALID = [
    "",
    ".",
    "..",
    "../x",
    "a/..",
    "/abs",
    "a\\b",
    "x" * 129,
    "caf\u00e9",
    "\u0661\u0662",  # arabic-indic digits: \d would accept them, the charset must not
    "a b",
    "a\n",  # `$`-style anchoring would accept a trailing newline
    "\nab",
    "a\x00b",
    "a:b",
    "*",
]
NOT_STR = [None, 5, b"abc", ["a"], 1.5]


@pytest.mark.parametrize("kind", CHECKERS)
@pytest.mark.parametrize("value", VALID)
def test_valid_names_are_returned_unchanged(kind: str, value: str) -> None:
    assert CHECKERS[kind](value) == value


@pytest.mark.parametrize("kind", CHECKERS)
@pytest.mark.parametrize("value", INVALID + NOT_STR)
def test_invalid_names_raise_invalid_name_stating_the_charset(kind: str, value: object) -> None:
    with pytest.raises(InvalidName) as info:
        CHECKERS[kind](value)
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, TierckptError)
    message = str(err)
    assert "[A-Za-z0-9._-]" in message
    assert "1-128" in message
    assert kind in message
    assert repr(value) in message


def test_only_checkpoint_ids_are_folder_paths() -> None:
    assert check_checkpoint_id("a/b") == "a/b"
    for check in (check_namespace, check_file_name):
        with pytest.raises(InvalidName):
            check("a/b")


@pytest.mark.parametrize(
    "value", ["run1/step-10", "team-a/run1/epoch=0-step=5", "/".join("abcdefgh"), "x/" + "y" * 128]
)
def test_nested_checkpoint_ids_are_folder_paths(value: str) -> None:
    assert check_checkpoint_id(value) == value
    flat = flat_checkpoint_id(value)
    assert "/" not in flat and checkpoint_id_of_flat(flat) == value


@pytest.mark.parametrize(
    "value",
    [
        "run1/..",
        "../run1",
        "run1/./step",
        "run1//step",
        "run1/",
        "/run1/step",
        "run1\\step",
        "run1/.hidden",  # no hidden folder: `.tierckpt` is the bucket's bookkeeping
        ".tierckpt/durable/x",
        "/".join("abcdefghi"),  # 9 segments
        "/".join(["x" * 100] * 3),  # 302 characters
        "run1/step 1",
        "run1/st+ep",
    ],
)
def test_nested_checkpoint_ids_never_leave_their_folder(value: str) -> None:
    with pytest.raises(InvalidName, match="checkpoint id"):
        check_checkpoint_id(value)


@pytest.mark.parametrize("name", ["a+..", "+", "a++b", "..", "a/b", "+a", ".x+y"])
def test_flat_names_read_back_are_validated(name: str) -> None:
    with pytest.raises(InvalidName):
        checkpoint_id_of_flat(name)


def test_metadata_file_is_a_valid_file_name() -> None:
    assert check_file_name(METADATA_FILE) == ".metadata"


@pytest.mark.parametrize(
    ("checkpoint_id", "step"),
    [
        ("step-000100", 100),
        ("step-100", 100),
        ("step-0", 0),
        ("7", 7),
        ("v2-step-5", 5),
        ("run3.step12", 12),
        ("step-" + "9" * 30, int("9" * 30)),
    ],
)
def test_step_of_takes_the_trailing_integer(checkpoint_id: str, step: int) -> None:
    assert step_of(checkpoint_id) == step


@pytest.mark.parametrize("checkpoint_id", ["", "latest", "step-1a", "step-", "12-final"])
def test_step_of_is_none_without_trailing_integer(checkpoint_id: str) -> None:
    assert step_of(checkpoint_id) is None


@pytest.mark.parametrize("kind", sorted(CHECKERS))
def test_error_quotes_a_huge_name_bounded(kind: str) -> None:
    # Audit M5: a 5 MiB name must not become a 5 MiB error message or log line.
    with pytest.raises(InvalidName) as info:
        CHECKERS[kind]("x" * 5_000_000)
    message = str(info.value)
    assert len(message) < 300
    assert "5000002 characters" in message


def test_latest_is_reserved_for_new_checkpoints_only() -> None:
    # tierckpt://<namespace>/latest names the newest checkpoint: one saved as "latest"
    # could never be reached through a URL, so a new checkpoint may not take the id...
    with pytest.raises(InvalidName, match=r"'latest' is reserved.*newest committed"):
        check_new_checkpoint_id("latest")
    assert check_new_checkpoint_id("latest-100") == "latest-100"
    assert check_new_checkpoint_id("Latest") == "Latest"
    # ...while reading, listing and deleting still accept it (a checkpoint an older
    # version saved under that id stays reachable natively).
    assert check_checkpoint_id("latest") == "latest"
    with pytest.raises(InvalidName, match="checkpoint id"):
        check_new_checkpoint_id("../latest")
