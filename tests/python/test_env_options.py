"""Every TETHER_* variable is parsed as its keyword is, and a bad one fails at construction naming it.

The option table (src/core/config.cc, exposed as tether._tether.options()) drives every test here: each
option's variable, set to each spelling its kind accepts, gives the Config the keyword gives; set to
garbage, Endpoint() raises InvalidArgument with one line naming the variable, the value and what it
accepts. The source is scanned for TETHER_* reads outside the table, and every other view of it
(README's table, option rows in docs/, Python's Config attributes, the Endpoint docstring) is checked
against it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tether
from tether import _tether

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

# Garbage no kind but text accepts, per kind (a second one is out of range or half a number).
GARBAGE = {"size": ["4Q", "1.3"], "count": ["abc", "99999999999999999999"], "bool": ["maybe", "2"],
           "seconds": ["soon", "-1"], "microseconds": ["-5", "5 us"], "choice": ["bogus", "AUTO "]}


def _table() -> list[dict]:
    return _tether.options()


def _config(options: dict):
    """The Config Endpoint(**options) would start with (nothing is created)."""
    from tether.api import _config as config
    return config(options)


@pytest.fixture
def clean_env(monkeypatch):
    """No TETHER_* variable set (CI may set some); monkeypatch restores them."""
    for name in [n for n in os.environ if n.startswith("TETHER_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def _spellings(o: dict) -> list[tuple[object, list[str], list[str]]]:
    """(keyword value, variable spellings, keyword text spellings) of values other than the default."""
    kind = o["kind"]
    if kind == "size":
        texts = ["3145728", "3M", "3MiB", "3m", "3072K", "3072KiB", "0.0029296875G", "0x300000"]
        return [(3 * MiB, texts, texts)]
    if kind == "count":
        return [(7, ["7", "0x7"], ["7", "0x7"])]
    if kind == "bool":
        if o["default"] == "1":
            texts = ["0", "false", "FALSE", "no", "off"]
            return [(False, texts, texts)]
        texts = ["1", "true", "True", "YES", "on"]
        return [(True, texts, texts)]
    if kind == "seconds":  # the variable counts milliseconds, the keyword seconds
        return [(2.5, ["2500", "2500ms", "2.5s"], ["2.5", "2500ms", "2.5s"])]
    if kind == "microseconds":
        return [(37, ["37", "37us", "0.037ms"], ["37", "37us", "0.037ms"])]
    if kind == "choice":
        return [(c, [c], [c]) for c in o["choices"].split(",")]
    assert kind == "text", f"{o['env']}: a kind this test does not know: {kind}"
    return [("eth9,eth8", ["eth9,eth8"], ["eth9,eth8"])]


def _all(cfg) -> dict:
    return {name: cfg.get(name) for name in (o["keyword"] for o in _table() if o["keyword"])}


@pytest.mark.budget(60)
def test_every_variable_takes_every_spelling_its_keyword_takes(clean_env):
    table = _table()
    assert len(table) >= 40 and len({o["env"] for o in table}) == len(table)
    defaults = _all(_config({}))
    failures = []
    for o in (o for o in table if o["keyword"]):
        kw, env = o["keyword"], o["env"]
        assert env.startswith("TETHER_") and o["help"], o
        for value, env_texts, kw_texts in _spellings(o):
            want = _all(_config({kw: value}))
            if o["kind"] != "choice":
                assert want[kw] != defaults[kw], f"{kw}: the test value is the default"
            assert {k: v for k, v in want.items() if k != kw} == {k: v for k, v in defaults.items() if k != kw}
            for text in kw_texts:  # a keyword given as text reads as the variable does
                got = _all(_config({kw: text}))
                if got != want:
                    failures.append(f"{kw}={text!r}: {got[kw]!r}, keyword {value!r} gives {want[kw]!r}")
            for text in env_texts:
                clean_env.setenv(env, text)
                try:
                    got = _all(_config({}))
                except tether.InvalidArgument as e:
                    failures.append(f"{env}={text!r} refused: {e}")
                    continue
                finally:
                    clean_env.delenv(env)
                if got != want:
                    failures.append(f"{env}={text!r}: {kw}={got[kw]!r}, keyword {value!r} gives {want[kw]!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.budget(60)
def test_every_bad_value_fails_construction_naming_the_variable(clean_env):
    checked = 0
    for o in _table():
        if o["kind"] == "text":
            continue
        for bad in GARBAGE[o["kind"]]:
            clean_env.setenv(o["env"], bad)
            try:
                with pytest.raises(tether.InvalidArgument) as e:
                    tether.Endpoint()
            finally:
                clean_env.delenv(o["env"])
            assert str(e.value) == f"{o['env']}='{bad}': expected {o['accepts']}"
            assert "\n" not in str(e.value)
            if o["keyword"]:  # the keyword as text is refused the same way, naming the option
                with pytest.raises(tether.InvalidArgument, match=re.escape(f"option {o['keyword']}='{bad}'")):
                    _config({o["keyword"]: bad})
            checked += 1
    assert checked >= 2 * 28


@pytest.mark.budget(60)
def test_process_wide_knobs_take_their_values(clean_env):
    """Rows without a keyword are read once by the code they steer; a value they take lets an endpoint
    start (their effect is tested where they act: test_gpu, test_fabric, test_netplugin)."""
    rows = [o for o in _table() if not o["keyword"] and o["kind"] != "text"]
    assert {o["env"] for o in rows} >= {"TETHER_FABRIC_STAGE_HOST", "TETHER_NET_FAULT"}
    for o in rows:
        for _, texts, _ in _spellings(o):
            for text in texts:
                clean_env.setenv(o["env"], text)
                tether.Endpoint().close()
        clean_env.delenv(o["env"])


def test_sizes_booleans_and_bad_numbers_from_the_environment(clean_env):
    """The three everyday cases: a size with a unit and a boolean are taken; a bad whole number, or a bad
    variable beside a good keyword, fails naming the variable and the form it expects."""
    clean_env.setenv("TETHER_CHUNK_BYTES", "4M")
    clean_env.setenv("TETHER_DISABLE_IPC", "true")
    with tether.Endpoint() as ep:
        assert ep.config.chunk_bytes == 4 * MiB
        assert ep.config.disable_ipc is True
    clean_env.setenv("TETHER_WINDOW", "abc")
    with pytest.raises(tether.InvalidArgument) as e:
        tether.Endpoint()
    assert str(e.value) == "TETHER_WINDOW='abc': expected a whole number from 0 to 4294967295"
    clean_env.setenv("TETHER_WINDOW", "8")
    clean_env.setenv("TETHER_CHUNK_BYTES", "4Q")
    with pytest.raises(tether.InvalidArgument) as e:
        tether.Endpoint(chunk_bytes=MiB)  # a keyword does not hide a bad variable
    assert str(e.value) == "TETHER_CHUNK_BYTES='4Q': expected a size in bytes (e.g. 4194304, 4M, 4MiB)"


def test_every_tether_variable_read_in_the_source_is_in_the_table():
    """Nothing reads a TETHER_* variable around the table's parser: every literal name handed to getenv,
    env_flag or env_text is a row."""
    names = {o["env"] for o in _table()}
    read = {}
    for path in (ROOT / "src").rglob("*"):
        if path.suffix in (".cc", ".h", ".cu"):
            for m in re.finditer(r'(?:getenv|env_flag|env_text)\("(TETHER_\w+)"\)', path.read_text()):
                read.setdefault(m.group(1), path.relative_to(ROOT))
    assert read, "no TETHER_* read found: has the source moved?"
    assert {n: p for n, p in read.items() if n not in names} == {}


def _meaning(o: dict) -> str:
    """README's "meaning" cell of a row: its help line, and a choice's values."""
    choices = ", ".join(f"`{c}`" for c in o["choices"].split(",")) if o["choices"] else ""
    return o["help"] + (f"; one of {choices}" if choices else "")


def _default_cell_matches(cell: str, o: dict) -> bool:
    """README's "default" cell says the row's default: verbatim in backticks, "—" for an empty one, on/off
    for a boolean, or a size, a duration in s or µs; free text only where the default depends on the CPUs."""
    d, units = o["default"], {"KiB": 1 << 10, "MiB": 1 << 20, "s": 1, "µs": 1}
    if cell in ("—", f"`{d}`"):
        return cell != "—" or d in ("", "0")
    if cell in ("on", "off"):
        return d == ("1" if cell == "on" else "0")
    m = re.fullmatch(r"([\d.]+) (KiB|MiB|s|µs)", cell)
    if m:
        return float(m.group(1)) * units[m.group(2)] == float(d)
    return "CPUs" in cell and "CPUs" in o["help"]


def test_readme_option_table_is_the_option_table():
    """Every row, in the table's order, with its help line as the meaning and its default."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Options\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| (—|`\w+`) \| `(TETHER_\w+)` \| ([^|]+) \| (.+) \|$", section, re.M)
    documented = [(kw.strip("`") if kw != "—" else None, env) for kw, env, _, _ in rows]
    table = _table()
    assert documented == [(o["keyword"], o["env"]) for o in table], (
        f"missing from README: {sorted(set((o['keyword'], o['env']) for o in table) - set(documented), key=str)}; "
        f"stale in README: {sorted(set(documented) - set((o['keyword'], o['env']) for o in table), key=str)}")
    stale = [f"| {kw or '—'} | {env} | {default} | {_meaning(o)} |" for (kw, env, default, meaning), o in zip(rows, table)
             if meaning != _meaning(o) or not _default_cell_matches(default, o)]
    assert not stale, "README rows to update (meaning = the help line):\n" + "\n".join(stale)


def test_option_rows_in_the_docs_pair_keywords_with_their_variables():
    """A docs table row naming an option and a variable pairs them as the option table does."""
    pairs = {(o["keyword"], o["env"]) for o in _table() if o["keyword"]}
    keywords = {kw for kw, _ in pairs}
    wrong = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for kw, env in re.findall(r"^\| `(\w+)` \| `(TETHER_\w+)` \|", path.read_text(), re.M):
            if (kw, env) not in pairs:
                wrong.append(f"{path.name}: {kw} / {env}" + ("" if kw in keywords else " (no such option)"))
    assert not wrong, wrong


def test_every_keyword_is_a_config_field_and_documented():
    """Python's Config has one attribute per keyword (seconds: keyword + "_ms") and no other; the
    Endpoint docstring lists every keyword with its variable and help line."""
    fields = {o["keyword"] + ("_ms" if o["kind"] == "seconds" else "") for o in _table() if o["keyword"]}
    attributes = {a for a in dir(_tether.Config) if not a.startswith("_") and not callable(getattr(_tether.Config, a))}
    assert attributes == fields
    doc = tether.Endpoint.__doc__
    for o in (o for o in _table() if o["keyword"]):
        assert f"    {o['keyword']}" in doc and o["env"] in doc and o["help"] in doc, o["keyword"]


def _nixl_plugin_dir(folder: Path) -> str:
    """Why the NIXL test cannot run here, or "" once `folder` holds this build's plugin (a folder of our
    own: NIXL's shared one may meanwhile get another build's plugin from another test run)."""
    try:
        import tether.nixl as tn
        info = tn.nixl_installed()
    except ImportError:
        return "tether.nixl unavailable"
    if not info:
        return "NIXL is not installed"
    if tn.plugin_path() is None:
        return "tether was built without NIXL headers"
    tn.install(str(folder))
    return ""


NIXL_CREATE = """
import sys
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("A", nixl_agent_config(backends=[]))
try:
    agent.create_backend("TETHER", dict(a.split("=", 1) for a in sys.argv[1:]))
except Exception as e:
    print("REFUSED", type(e).__name__)
else:
    print("CREATED")
"""


@pytest.mark.budget(90)
def test_nixl_backend_parameters_and_variables_use_the_same_parser(tmp_path):
    why = _nixl_plugin_dir(tmp_path)
    if why:
        pytest.skip(why)

    def create(*params, env=None):
        e = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
        e.update(NIXL_LOG_LEVEL="WARN", NIXL_PLUGIN_DIR=str(tmp_path), **(env or {}))
        r = subprocess.run([sys.executable, "-c", NIXL_CREATE, *params], env=e, capture_output=True, text=True,
                           timeout=60)
        return (r.stdout.strip().splitlines() or [""])[-1], r.stdout + r.stderr

    outcome, log = create("chunk_bytes=4M", "peer_timeout=2.5s", "disable_ipc=yes")
    assert outcome == "CREATED", log
    outcome, log = create("chunk_bytes=4Q")
    assert outcome.startswith("REFUSED") and "option chunk_bytes='4Q': expected a size in bytes" in log, log
    outcome, log = create(env={"TETHER_WINDOW": "abc"})
    assert outcome.startswith("REFUSED") and "TETHER_WINDOW='abc': expected a whole number" in log, log
