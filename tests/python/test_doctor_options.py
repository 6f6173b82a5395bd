"""`tether doctor` prints the effective configuration: every row of the option table, its value as an
Endpoint created in that environment would use it, and where the value came from; a bad variable is one
line naming it. tether.api.effective_options is what it prints, tested here in-process too."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tether
from tether import _tether
from tether.api import effective_options

TETHER_PATH = os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__)))
SET = {"TETHER_CHUNK_BYTES": "4M", "TETHER_PEER_TIMEOUT_MS": "2500", "TETHER_DISABLE_IPC": "yes",
       "TETHER_NET_FAULT": "consume_early", "TETHER_AUTH_TOKEN": "hunter2-secret"}
# What each of SET reads as: the value as its keyword takes it (seconds for peer_timeout).
WANT = {"TETHER_CHUNK_BYTES": "4194304", "TETHER_PEER_TIMEOUT_MS": "2.5", "TETHER_DISABLE_IPC": "1",
        "TETHER_NET_FAULT": "consume_early", "TETHER_AUTH_TOKEN": "(set)"}


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_") and k != "COLUMNS"}
    e.update(PYTHONPATH=TETHER_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-m", "tether", "doctor", *args], env=e, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TETHER_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_effective_options_say_where_each_value_came_from(clean_env):
    clean_env.setenv("TETHER_WINDOW", "8")
    clean_env.setenv("TETHER_CHUNK_BYTES", "2M")
    clean_env.setenv("TETHER_NET_FAULT", "")  # empty counts as unset
    rows = {o["env"]: o for o in effective_options(chunk_bytes="4M", port=None)}
    assert [o["env"] for o in _tether.options()] == list(rows)  # every row of the table, in its order
    assert rows["TETHER_WINDOW"]["value"] == "8" and rows["TETHER_WINDOW"]["source"] == "environment"
    assert rows["TETHER_CHUNK_BYTES"]["value"] == str(4 << 20) and rows["TETHER_CHUNK_BYTES"]["source"] == "keyword"
    assert rows["TETHER_PORT"]["source"] == "default"  # None keeps the lower layers
    assert rows["TETHER_NET_FAULT"]["source"] == "default"
    defaults = {o["env"]: o["default"] for o in _tether.options()}
    for env, o in rows.items():
        assert o["help"]
        if env not in ("TETHER_WINDOW", "TETHER_CHUNK_BYTES"):
            assert (o["source"], o["value"]) == ("default", defaults[env]), o


def test_doctor_json_names_the_variables_set_and_their_parsed_values():
    r = doctor("--json", **SET)
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout  # secrets are never printed
    report = json.loads(r.stdout)
    assert report["config_error"] is None
    rows = {o["env"]: o for o in report["options"]}
    assert {env: (o["source"], o["value"]) for env, o in rows.items() if o["source"] != "default"} == {
        env: ("environment", WANT[env]) for env in SET}
    assert rows["TETHER_NET_FAULT"]["keyword"] is None and rows["TETHER_CHUNK_BYTES"]["keyword"] == "chunk_bytes"


@pytest.mark.budget(60)
def test_doctor_prints_the_effective_configuration():
    r = doctor(**SET)
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout and "the value an endpoint started here uses" in r.stdout
    lines = {env: next((line for line in r.stdout.splitlines() if env in line and " = " in line), "") for env in SET}
    shown = {"TETHER_CHUNK_BYTES": "4194304", "TETHER_PEER_TIMEOUT_MS": "2.5s", "TETHER_DISABLE_IPC": " on ",
             "TETHER_NET_FAULT": "consume_early", "TETHER_AUTH_TOKEN": "(set)"}
    for env, line in lines.items():
        assert "environment" in line and shown[env] in line, (env, r.stdout[-6000:])
    assert "TETHER_* set that are not options" not in r.stdout


@pytest.mark.budget(90)
@pytest.mark.parametrize("env,value", [("TETHER_WINDOW", "abc"), ("TETHER_NET_FAULT", "bogus")])
def test_doctor_names_a_bad_variable_in_one_line(env, value):
    r = doctor(**{env: value, "TETHER_CHNNELS": "4"})
    assert r.returncode == 0, r.stderr
    named = [line for line in r.stdout.splitlines() if f"{env}='{value}'" in line]
    assert len(named) == 1 and named[0].startswith("tether cannot start with this environment:"), r.stdout[-4000:]
    assert "TETHER_* set that are not options: TETHER_CHNNELS=4" in r.stdout  # a misspelt name is shown
    report = json.loads(doctor("--json", **{env: value}).stdout)
    assert report["options"] is None and report["config_error"].startswith(f"{env}='{value}': expected ")
