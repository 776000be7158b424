"""Unit tests of the run secret at work on records (``_runtime/store/seals.py``) and of how
the secret is read (``axolotl_dist/env/variables.kit_secret``): a sealed record opens only at its
own key under its own secret, an encrypted answer only under its secret, and a bad secret is
an error naming the variable and the fix. No store, no process (the secret comes from this
process's environment, set per test)."""

from __future__ import annotations

import os

import pytest

from axolotl_dist._runtime.store import records, seals
from axolotl_dist.errors import DistributedEnvError

SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.delenv("AXOLOTL_DIST_SECRET_FILE", raising=False)
    monkeypatch.setenv("AXOLOTL_DIST_SECRET", SECRET)
    return monkeypatch


@pytest.fixture
def no_secret(monkeypatch):
    monkeypatch.delenv("AXOLOTL_DIST_SECRET_FILE", raising=False)
    monkeypatch.delenv("AXOLOTL_DIST_SECRET", raising=False)
    return monkeypatch


def test_a_sealed_record_opens_at_its_key_and_costs_27_bytes(secret):
    sealed = seals.seal("axd/exit/1", b'{"v":1}')
    assert sealed.startswith(seals.MARK) and len(sealed) == len(b'{"v":1}') + 27
    assert seals.opened("axd/exit/1", sealed) == b'{"v":1}'
    assert seals.seal("axd/exit/1", "text") == seals.seal("axd/exit/1", b"text")  # one value


@pytest.mark.parametrize("forged, why", [
    (b'{"v":1}', "no seal"),
    (seals.MARK + b"A" * 22 + b':{"v":1}', "not this run's"),
    (b"", "no seal"),
])
def test_a_record_without_this_runs_seal_is_not_this_runs(secret, forged, why):
    with pytest.raises(seals.NotThisRun, match=why):
        seals.opened("axd/exit/1", forged)


def test_a_seal_does_not_move_to_another_key_or_secret(secret):
    sealed = seals.seal("axd/exit/1", b"x")
    with pytest.raises(seals.NotThisRun):
        seals.opened("axd/exit/2", sealed)
    secret.setenv("AXOLOTL_DIST_SECRET", SECRET[::-1])
    with pytest.raises(seals.NotThisRun):
        seals.opened("axd/exit/1", sealed)


def test_without_a_secret_records_are_as_before_and_a_sealed_one_is_refused(no_secret):
    assert seals.seal("k", b"x") == b"x" and seals.opened("k", b"x") == b"x"
    assert not seals.sealing()
    no_secret.setenv("AXOLOTL_DIST_SECRET", SECRET)
    sealed = seals.seal("k", b"x")
    no_secret.setenv("AXOLOTL_DIST_SECRET", "off")
    with pytest.raises(records.BadRecord, match="AXOLOTL_DIST_SECRET") as info:
        seals.opened("k", sealed)
    assert not isinstance(info.value, seals.NotThisRun)


def test_an_answer_decrypts_only_under_its_secret_and_key(secret):
    plain = b'{"user": [["train.py", 12, "tokenize", null]]}'
    token = seals.encrypt("axd/where/1", plain)
    assert token is not None and token.startswith(seals.ENCRYPTED)
    assert b"user" not in token and b"train.py" not in token
    assert seals.decrypt("axd/where/1", token) == plain
    assert seals.encrypt("axd/where/1", plain) != token  # a fresh nonce each time
    with pytest.raises(seals.NotThisRun, match="for this key"):
        seals.decrypt("axd/where/2", token)  # moved to another rank's answer
    secret.setenv("AXOLOTL_DIST_SECRET", SECRET[::-1])
    with pytest.raises(seals.NotThisRun):
        seals.decrypt("axd/where/1", token)
    with pytest.raises(seals.NotThisRun):
        seals.decrypt("axd/where/1", plain)  # plain text where an answer must be encrypted


@pytest.mark.parametrize("size", [0, 1, 31, 4096, 100_000])
def test_an_answer_of_any_size_round_trips(secret, size):
    plain = os.urandom(size)
    assert seals.decrypt("k", seals.encrypt("k", plain)) == plain


def test_a_changed_byte_of_an_answer_is_refused(secret):
    token = bytearray(seals.encrypt("k", b"x" * 40))
    for i in range(len(seals.ENCRYPTED), len(token), 7):
        forged = bytearray(token)
        forged[i] = ord("A") if forged[i] != ord("A") else ord("B")
        with pytest.raises(seals.NotThisRun):
            seals.decrypt("k", bytes(forged))
    with pytest.raises(seals.NotThisRun, match="too short"):
        seals.decrypt("k", seals.ENCRYPTED + b"AAAA")


def test_answers_need_no_optional_package(secret, monkeypatch):
    # the default install has no `cryptography`: encryption must not need it (issue #77)
    import sys
    monkeypatch.setitem(sys.modules, "cryptography", None)  # import fails
    assert seals.decrypt("k", seals.encrypt("k", b"stack")) == b"stack"


def test_nothing_is_encrypted_without_a_secret(no_secret):
    assert seals.encrypt("k", b"x") is None
    with pytest.raises(records.BadRecord, match="AXOLOTL_DIST_SECRET"):
        seals.decrypt("k", seals.ENCRYPTED + b"AAAA")


@pytest.mark.parametrize("value, message", [
    ("short", "AXOLOTL_DIST_SECRET has 5 characters; give every rank the same secret of at "
              "least 16 characters"),
])
def test_a_short_secret_is_refused_with_the_fix(no_secret, value, message):
    no_secret.setenv("AXOLOTL_DIST_SECRET", value)
    with pytest.raises(DistributedEnvError, match="openssl rand -hex 32") as info:
        seals.seal("k", b"x")
    assert str(info.value).startswith(message)


def test_off_and_unset_mean_no_secret(no_secret):
    assert not seals.sealing()
    no_secret.setenv("AXOLOTL_DIST_SECRET", " OFF ")
    assert not seals.sealing()


def test_a_secret_file_is_read_and_must_be_private(no_secret, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    os.chmod(path, 0o600)
    no_secret.setenv("AXOLOTL_DIST_SECRET_FILE", str(path))
    sealed = seals.seal("k", b"x")
    no_secret.delenv("AXOLOTL_DIST_SECRET_FILE")
    no_secret.setenv("AXOLOTL_DIST_SECRET", SECRET)
    assert seals.opened("k", sealed) == b"x"  # the same secret by file or by value
    loose = tmp_path / "loose"
    loose.write_text(SECRET)
    os.chmod(loose, 0o644)
    no_secret.delenv("AXOLOTL_DIST_SECRET")
    no_secret.setenv("AXOLOTL_DIST_SECRET_FILE", str(loose))
    with pytest.raises(DistributedEnvError, match=f"mode 644\\): chmod 600 {loose}"):
        seals.sealing()
    no_secret.setenv("AXOLOTL_DIST_SECRET", SECRET)
    with pytest.raises(DistributedEnvError, match="both AXOLOTL_DIST_SECRET and "
                                                  "AXOLOTL_DIST_SECRET_FILE are set"):
        seals.sealing()
