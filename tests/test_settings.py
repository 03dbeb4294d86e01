"""The one writer of a rank's environment (launcher.placement.settings): the user's values
stay, the launcher's own decisions win, and every one is recorded with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.placement import settings
from tests.fixtures.mpi import REPO_ROOT


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(settings, "_applied", {})
    for name in ("DDP_TEST_A", "DDP_TEST_B"):
        monkeypatch.delenv(name, raising=False)
    yield settings
    for name in ("DDP_TEST_A", "DDP_TEST_B"):
        os.environ.pop(name, None)


def test_the_users_value_stays_and_is_recorded_as_theirs(fresh, monkeypatch):
    monkeypatch.setenv("DDP_TEST_A", "mine")
    assert fresh.prefer("DDP_TEST_A", "ours", "because") == "mine"
    assert os.environ["DDP_TEST_A"] == "mine"
    assert fresh.applied() == [{"name": "DDP_TEST_A", "value": "mine", "why": "because",
                                "source": "user"}]


def test_an_unset_variable_is_set_with_its_reason(fresh):
    assert fresh.prefer("DDP_TEST_A", "ours", "because") == "ours"
    fresh.decide("DDP_TEST_B", "1", "decided")
    assert (os.environ["DDP_TEST_A"], os.environ["DDP_TEST_B"]) == ("ours", "1")
    assert [(s["name"], s["source"]) for s in fresh.applied()] == [
        ("DDP_TEST_A", "launcher"), ("DDP_TEST_B", "launcher")]


def test_what_the_launcher_set_is_not_the_users(fresh):
    fresh.decide("DDP_TEST_A", "0", "first decision")
    assert fresh.user_value("DDP_TEST_A") is None
    assert fresh.prefer("DDP_TEST_A", "1", "later") == "1"


def test_the_env_cli_shows_what_was_set():
    code = ("from launcher.placement import settings; from launcher.placement.env import main; "
            "settings.prefer('DDP_TEST_A', 'x', 'a test'); main(['--json'])")
    env = {k: v for k, v in os.environ.items() if k != "DDP_TEST_A"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["library_settings"] == [
        {"name": "DDP_TEST_A", "value": "x", "why": "a test", "source": "launcher"}]
