"""Config: defaults < TOML < SPECD_* environment < flags; bad input is one clear line, exit 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon_helpers import base_env
from specd.config import (DEVICE_TYPES, UNIX_PATH_MAX, ConfigError, config_path, load_config, parse_host_port,
                          parse_loopback_address, unknown_environment)


def write_config(text: str):
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_precedence_and_sources():
    path = write_config('[engine]\nmax_tokens = 64\ndraft_max = 5\n[log]\nlevel = "debug"\n')
    cfg = load_config(environ={"SPECD_ENGINE_DRAFT_MAX": "6", "SPECD_LOG_LEVEL": "warning"},
                      overrides={"log.level": "error", "model.target": None})
    assert cfg["engine.max_tokens"] == 64 and cfg.sources["engine.max_tokens"] == str(path)
    assert cfg["engine.draft_max"] == 6 and cfg.sources["engine.draft_max"] == "environment SPECD_ENGINE_DRAFT_MAX"
    assert cfg["log.level"] == "error" and cfg.sources["log.level"] == "command line"
    assert cfg["model.target"] == "" and "model.target" not in cfg.sources
    assert cfg["engine.kv_reuse"] is True


def test_draft_confidence_is_auto_by_default_or_a_probability_from_anywhere():
    """A number key that also takes a word: ``auto`` (measured at load) from a file, the
    environment or a flag, any case; a probability as before; anything else one line naming both."""
    assert load_config(environ={})["engine.draft_confidence"] == "auto"
    write_config('[engine]\ndraft_confidence = "AUTO"\n')
    assert load_config(environ={})["engine.draft_confidence"] == "auto"
    write_config("[engine]\ndraft_confidence = 0.4\n")
    assert load_config(environ={})["engine.draft_confidence"] == 0.4
    assert load_config(environ={"SPECD_ENGINE_DRAFT_CONFIDENCE": "auto"})["engine.draft_confidence"] == "auto"
    assert load_config(environ={"SPECD_ENGINE_DRAFT_CONFIDENCE": "0.25"})["engine.draft_confidence"] == 0.25
    assert load_config(environ={}, overrides={"engine.draft_confidence": "auto"})["engine.draft_confidence"] == "auto"
    write_config('[engine]\ndraft_confidence = "sure"\n')
    with pytest.raises(ConfigError, match="'sure' is not a valid float or auto"):
        load_config(environ={})


@pytest.mark.parametrize("text, fragment", [
    ("[engine]\nmax_tokenz = 3\n", "unknown config key 'engine.max_tokenz'"),
    ("[engin]\nmax_tokens = 3\n", "unknown config key 'engin.max_tokens'"),
    ("[engine]\nmax_tokens = -1\n", "engine.max_tokens"),
    ("[engine]\nmax_tokens = 'many'\n", "engine.max_tokens"),
    ("[engine]\nuse_lookup = 3\n", "engine.use_lookup"),
    ("[model]\ndtype = 'float64'\n", "not one of"),
    ("[engine]\ndraft_confidence = 1.5\n", "between 0 and 1"),
    ("[engine\n", "not valid TOML"),
    ("max_tokens = 3\n", "unknown config key 'max_tokens'"),
])
def test_bad_file_is_one_line_naming_key_and_file(text, fragment):
    path = write_config(text)
    with pytest.raises(ConfigError) as info:
        load_config(environ={})
    message = str(info.value)
    assert fragment in message and str(path) in message and "\n" not in message


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="SPECD_ENGINE_KV_REUSE"):
        load_config(environ={"SPECD_ENGINE_KV_REUSE": "perhaps"})


def test_unknown_environment_variable_is_a_warning_and_the_rest_applies():
    # A stray SPECD_* variable (another tool's, a typo) must not cost an editor its completions.
    cfg = load_config(environ={"SPECD_RENDERER": "x", "SPECD_ENGINE_BOGUS": "1", "SPECD_ENGINE_MAX_TOKENS": "7"})
    assert cfg["engine.max_tokens"] == 7
    assert len(cfg.warnings) == 2 and all("\n" not in line for line in cfg.warnings)
    assert "SPECD_ENGINE_BOGUS" in cfg.warnings[0] and "SPECD_RENDERER" in cfg.warnings[1]
    assert unknown_environment({"SPECD_RENDERER": "x", "SPECD_TEST_X": "1", "SPECD_CONFIG": "f"}) == [cfg.warnings[1]]
    with pytest.raises(ConfigError, match="SPECD_RENDERER"):
        load_config(environ={"SPECD_RENDERER": "x"}, strict_environment=True)


def test_cli_warns_once_about_an_unknown_variable_and_goes_on():
    proc = subprocess.run([sys.executable, "-m", "specd", "doctor", "--no-load"], capture_output=True, text=True,
                          env={**os.environ, "SPECD_RENDERER": "x", "SPECD_ENGINE_MAX_TOKENS": "7"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("SPECD_RENDERER") == 1 and "Traceback" not in proc.stderr
    assert "engine.max_tokens" in proc.stdout and "SPECD_ENGINE_MAX_TOKENS" in proc.stdout


@pytest.mark.parametrize("text, fragment", [
    ("[daemon]\nmax_frame_bytes = 100000000000000000000\n", "too large"),
    ("[daemon]\nmax_frame_bytes = 9000000000000000000\n", "too large"),
    ("[daemon]\nmax_frame_bytes = 1e20\n", "expected int"),
    ("[daemon]\nmax_frame_bytes = 10\n", "must be >= 1024"),
    ("[engine]\ncache_budget_mb = 99999999999\n", "too large"),
    ("[engine]\ntime_budget_ms = 0\n", "must be >= 1"),
    ("[engine]\ndraft_confidence = nan\n", "between 0 and 1"),
    ("[engine]\nthreads = -1\n", "must be >= 0"),
])
def test_absurd_numbers_are_rejected_at_load(text, fragment):
    path = write_config(text)
    with pytest.raises(ConfigError) as info:
        load_config(environ={})
    assert fragment in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_absurd_number_in_the_environment_is_rejected():
    with pytest.raises(ConfigError, match="SPECD_DAEMON_MAX_FRAME_BYTES.*too large"):
        load_config(environ={"SPECD_DAEMON_MAX_FRAME_BYTES": str(10**20)})


def _special_config(kind: str):
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    if path.is_dir():
        path.rmdir()
    if kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind, fragment", [("directory", "is a directory"), ("fifo", "not a regular file")])
def test_config_that_is_not_a_file_is_one_line_exit_2(kind, fragment):
    path = _special_config(kind)
    try:
        with pytest.raises(ConfigError, match=fragment):
            load_config(environ={})
        # No reader blocks on the FIFO, no traceback for the directory: one line, exit 2.
        proc = subprocess.run([sys.executable, "-m", "specd", "doctor", "--no-load"], capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and fragment in proc.stderr and str(path) in proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        path.rmdir() if path.is_dir() else path.unlink()


def test_cli_exit_code_2_and_one_line_on_broken_config():
    path = write_config("[engine]\nmax_tokenz = 3\n")
    proc = subprocess.run([sys.executable, "-m", "specd", "doctor", "--no-load"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "engine.max_tokenz" in proc.stderr and str(path) in proc.stderr
    assert "Traceback" not in proc.stderr


# -- every bad value through the real CLI ------------------------------------------------------

# What each command is run as; {file} is a source file to complete in.
CLI_COMMANDS = {
    "serve": ("serve",),
    "complete": ("complete", "{file}", "--line", "1", "--col", "0", "--no-spawn"),
    "doctor": ("doctor", "--no-load"),
    "status": ("status",),
}
ALL_COMMANDS = tuple(CLI_COMMANDS)
MODEL_COMMANDS = ("serve", "complete", "doctor")  # the commands that take the model flags
CASE_TIMEOUT_S = 5.0  # the whole case, every command run at once


@dataclass(frozen=True)
class BadConfig:
    """One bad configuration: in the file (``toml``), the environment (``env``) or as flags
    (``flags``, after the command; ``global_flags`` before it). ``says`` are fragments the one
    line must hold besides the key and the source: what is wrong and what is allowed."""

    id: str
    key: str
    says: tuple[str, ...]
    toml: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()
    global_flags: tuple[str, ...] = ()
    commands: tuple[str, ...] = ALL_COMMANDS


def _file(id, key, value, *says, commands=ALL_COMMANDS, extra=""):
    section, _, name = key.partition(".")
    return BadConfig(id, key, says, toml=f"[{section}]\n{name} = {value}\n{extra}", commands=commands)


def _env(id, key, value, *says, extra=()):
    name = "SPECD_" + key.replace(".", "_").upper()
    return BadConfig(id, key, (name, *says), env=((name, value), *extra))


LONG_SOCKET = "/tmp/" + "s" * UNIX_PATH_MAX + ".sock"
TOKEN = 'tcp_token = "t"\n'

BAD_CONFIGS = [
    # ports and hosts of the TCP listener
    _file("tcp-port-too-big", "daemon.tcp", '"127.0.0.1:99999"', "port 99999", "1-65535", extra=TOKEN),
    _file("tcp-port-zero", "daemon.tcp", '"127.0.0.1:0"', "port 0", "1-65535", extra=TOKEN),
    _file("tcp-port-negative", "daemon.tcp", '"127.0.0.1:-1"', "'-1'", "1-65535", extra=TOKEN),
    _file("tcp-port-name", "daemon.tcp", '"127.0.0.1:http"', "'http'", "1-65535", extra=TOKEN),
    _file("tcp-no-port", "daemon.tcp", '"127.0.0.1"', "no port", "HOST:PORT", extra=TOKEN),
    _file("tcp-empty-port", "daemon.tcp", '"127.0.0.1:"', "''", "1-65535", extra=TOKEN),
    _file("tcp-no-host", "daemon.tcp", '":7878"', "no host", "HOST:PORT", extra=TOKEN),
    _file("tcp-any-address", "daemon.tcp", '"0.0.0.0:7878"', "not a loopback address", "127.0.0.1", extra=TOKEN),
    _file("tcp-hostname", "daemon.tcp", '"example.com:7878"', "not an IP address", "localhost", extra=TOKEN),
    _file("tcp-bare-ipv6", "daemon.tcp", '"::1:7878"', "in brackets", "[::1]:7878", extra=TOKEN),
    _file("tcp-without-token", "daemon.tcp", '"127.0.0.1:7878"', "daemon.tcp_token is empty"),
    _file("tcp-number", "daemon.tcp", "7878", "expected str"),
    BadConfig("tcp-flag-port-too-big", "daemon.tcp", ("command line", "port 70000", "1-65535"),
              toml="[daemon]\n" + TOKEN, flags=("--tcp", "127.0.0.1:70000"), commands=("serve",)),
    BadConfig("tcp-flag-no-port", "daemon.tcp", ("command line", "no port"),
              toml="[daemon]\n" + TOKEN, flags=("--tcp", "localhost"), commands=("serve",)),
    _env("tcp-env-port-too-big", "daemon.tcp", "[::1]:65536", "port 65536", "1-65535",
         extra=(("SPECD_DAEMON_TCP_TOKEN", "t"),)),
    # the remote server's URL
    _file("url-no-scheme", "model.remote_url", '"gpu-box:8000"', "not an http:// or https:// URL"),
    _file("url-ftp", "model.remote_url", '"ftp://gpu-box"', "not an http:// or https:// URL"),
    _file("url-port-too-big", "model.remote_url", '"http://gpu-box:99999"', "1-65535"),
    _file("url-port-name", "model.remote_url", '"http://gpu-box:http"', "1-65535"),
    _file("url-no-host", "model.remote_url", '"http://:8000"', "no host"),
    _file("url-space", "model.remote_url", '"http://gpu box:8000"', "whitespace"),
    _file("remote-without-url", "model.backend", '"remote"', "model.remote_url is empty", "http://"),
    _file("api-key-newline", "model.remote_api_key", '"abc\\ndef"', "control character"),
    # devices
    _file("device-tpu", "model.device", '"tpu"', "not a device name", "cuda:N"),
    _file("device-upper-case", "model.device", '"CUDA"', "not a device name", "cuda:N"),
    _file("device-bad-index", "model.device", '"cuda:x"', "not a device name"),
    _file("device-negative-index", "model.device", '"cuda:-1"', "not a device name"),
    _file("device-empty", "model.device", '""', "not a device name"),
    _file("device-meta", "model.device", '"meta"', "not a device name"),
    _env("device-env", "model.device", "gpu", "not a device name"),
    BadConfig("device-flag", "model.device", ("command line", "not a device name"),
              flags=("--device", "tpu"), commands=MODEL_COMMANDS),
    # paths the daemon and its clients must agree on
    _file("socket-relative", "daemon.socket", '"specd.sock"', "relative path", "absolute"),
    _file("socket-dot-relative", "daemon.socket", '"./run/specd.sock"', "relative path", "absolute"),
    _file("socket-too-long", "daemon.socket", f'"{LONG_SOCKET}"', f"{UNIX_PATH_MAX} bytes"),
    _file("socket-nul", "daemon.socket", '"/tmp/a\\u0000b.sock"', "NUL"),
    BadConfig("socket-flag-relative", "daemon.socket", ("command line", "relative path"),
              global_flags=("--socket", "specd.sock")),
    _env("socket-env-relative", "daemon.socket", "run/specd.sock", "relative path"),
    _file("log-file-relative", "log.file", '"specd.log"', "relative path", "absolute"),
    _file("folders-relative", "workspace.folders", '"/tmp:src"', "relative path 'src'", "absolute"),
    # sizes and budgets
    _file("max-tokens-zero", "engine.max_tokens", "0", ">= 1"),
    _file("max-tokens-negative", "engine.max_tokens", "-5", ">= 1"),
    _file("cache-budget-zero", "engine.cache_budget_mb", "0", ">= 1"),
    _file("time-budget-zero", "engine.time_budget_ms", "0", ">= 1"),
    _file("prefix-tokens-zero", "engine.prefix_tokens", "0", ">= 1"),
    _file("draft-max-huge", "engine.draft_max", "100000", "at most 256"),
    _file("max-connections-zero", "daemon.max_connections", "0", ">= 1"),
    _file("max-documents-negative", "daemon.max_documents", "-1", ">= 1"),
    _file("idle-unload-negative", "daemon.idle_unload_s", "-1", ">= 0"),
    BadConfig("idle-unload-flag-negative", "daemon.idle_unload_s", ("command line", ">= 0"),
              flags=("--idle-unload", "-1"), commands=("serve",)),
    _file("frame-too-small", "daemon.max_frame_bytes", "10", ">= 1024"),
    _file("connect-timeout-zero", "model.remote_connect_timeout_ms", "0", ">= 1"),
    _file("confidence-negative", "engine.draft_confidence", "-0.1", "between 0 and 1"),
    _file("confidence-inf", "engine.draft_confidence", "inf", "between 0 and 1"),
    _file("total-bytes-huge", "workspace.max_total_bytes", "9000000000000000000", "too large"),
    # enumerations
    _file("dtype-unknown", "model.dtype", '"float64"', "not one of", "bfloat16"),
    _file("backend-unknown", "model.backend", '"cloud"', "not one of", "remote"),
    _file("log-level-unknown", "log.level", '"verbose"', "not one of", "debug"),
    _file("fim-family-unknown", "model.fim_family", '"gpt"', "not one of", "qwen"),
    _file("forward-backend-unknown", "engine.forward_backend", '"onnx"', "not one of", "llamacpp"),
    # types
    _file("int-as-text", "engine.max_tokens", '"many"', "not a valid int"),
    _file("int-as-float", "engine.max_tokens", "1.5", "expected int"),
    _file("bool-as-int", "engine.use_lookup", "3", "expected bool"),
    _file("str-as-int", "model.target", "5", "expected str"),
    _file("str-as-list", "workspace.folders", '["/tmp"]', "expected str"),
    _file("float-as-text", "engine.draft_confidence", '"high"', "not a valid float"),
    BadConfig("section-as-value", "model", ("top level holds sections",), toml="model = 3\n"),
    # unknown keys
    _file("unknown-key", "engine.max_tokenz", "3", "unknown config key", "engine.max_tokens"),
    BadConfig("unknown-section", "engin.max_tokens", ("unknown config key", "sections model"),
              toml="[engin]\nmax_tokens = 3\n"),
    # environment variable spellings
    _env("env-int-empty", "engine.max_tokens", "", "not a valid int"),
    _env("env-int-suffix", "engine.max_tokens", "12abc", "not a valid int"),
    _env("env-int-float", "engine.max_tokens", "1e3", "not a valid int"),
    _env("env-bool-word", "engine.kv_reuse", "perhaps", "not a valid bool"),
    _env("env-enum-case", "log.level", "DEBUG", "not one of"),
    BadConfig("env-config-missing", "SPECD_CONFIG", ("does not exist",), env=(("SPECD_CONFIG", "/nonexistent/c.toml"),)),
    BadConfig("flag-config-missing", "--config", ("does not exist", "/nonexistent/c.toml"),
              global_flags=("--config", "/nonexistent/c.toml")),
]


@dataclass
class CliResult:
    command: str
    returncode: int | None  # None: still running at the deadline (then killed)
    stdout: str
    stderr: str
    seconds: float
    left_behind: bool  # some process of its session outlived it


def run_bad_config(case: BadConfig, root: Path, env_overrides: dict[str, str] | None = None,
                   timeout: float = CASE_TIMEOUT_S) -> list[CliResult]:
    """Run ``case`` through each of its commands at once, in private XDG dirs under ``root``,
    each in a session of its own; kill whatever is left at the deadline."""
    env = base_env(root)
    env.update(case.env)
    env.update(env_overrides or {})
    config = root / "config" / "specd" / "config.toml"
    if case.toml is not None:
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(case.toml, encoding="utf-8")
    source = root / "m.py"
    source.write_text("def f(x):\n    return x\n", encoding="utf-8")
    cwd = root / "cwd"  # a relative path in the config would land here
    cwd.mkdir(exist_ok=True)
    started, procs = time.monotonic(), {}
    for name in case.commands:
        argv = [a.format(file=source) for a in CLI_COMMANDS[name]]
        procs[name] = subprocess.Popen([sys.executable, "-m", "specd", *case.global_flags, *argv, *case.flags],
                                       env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True)
    results = []
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.0, started + timeout - time.monotonic()))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            code = None
        elapsed = time.monotonic() - started
        try:
            os.killpg(proc.pid, 0)  # the session's group outlived its leader: something was left running
            os.killpg(proc.pid, signal.SIGKILL)
            left = True
        except ProcessLookupError:
            left = False
        results.append(CliResult(name, code, out, err, elapsed, left))
    return results


def _source_of(case: BadConfig, root: Path) -> str:
    if case.flags or case.global_flags:
        return "command line"
    if case.env:
        return case.env[0][0]
    return str(root / "config" / "specd" / "config.toml")


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[case.id for case in BAD_CONFIGS])
def test_every_bad_config_is_one_line_and_exit_2_from_every_command(case, tmp_path):
    results = run_bad_config(case, tmp_path)
    for result in results:
        where = f"specd {result.command}: {result.stderr!r}"
        assert result.returncode == 2, where
        assert result.seconds < CASE_TIMEOUT_S and not result.left_behind, where
        line = result.stderr.rstrip("\n")
        assert "\n" not in line and "Traceback" not in line, where
        assert line.startswith("specd: config error: ") and result.stdout == "", where
        for fragment in (case.key, _source_of(case, tmp_path), *case.says):
            assert fragment in line, f"{fragment!r} missing from {where}"
    assert not any((tmp_path / "run").rglob("*.sock")) and not any((tmp_path / "cwd").iterdir())


def test_good_addresses_devices_and_paths_load():
    cfg = load_config(environ={"SPECD_DAEMON_TCP": "[::1]:1", "SPECD_DAEMON_TCP_TOKEN": "t",
                               "SPECD_MODEL_DEVICE": "cuda:10", "SPECD_DAEMON_SOCKET": "~/s.sock",
                               "SPECD_LOG_FILE": "~/specd.log", "SPECD_WORKSPACE_FOLDERS": "/src:~/lib:",
                               "SPECD_MODEL_REMOTE_URL": "https://gpu-box:65535/base"})
    home = os.path.expanduser("~")
    assert cfg.socket_path == Path(home) / "s.sock" and cfg.log_file == Path(home) / "specd.log"
    assert cfg["workspace.folders"] == f"/src:{home}/lib:"
    assert parse_loopback_address("localhost:7878") == ("127.0.0.1", 7878)
    assert parse_loopback_address("[::1]:65535") == ("::1", 65535)
    assert parse_host_port("gpu-box:1") == ("gpu-box", 1)
    for name in ("auto", "cpu", "cuda", "cuda:0", "mps", "xpu:3"):
        assert load_config(environ={"SPECD_MODEL_DEVICE": name})["model.device"] == name


def test_device_names_the_config_accepts_are_the_ones_torch_parses():
    # The config spells devices without importing torch; torch must agree with each spelling.
    import torch

    def torch_parses(name: str) -> bool:
        try:
            torch.device(name)
            return True
        except RuntimeError:
            return False

    def config_accepts(name: str) -> bool:
        try:
            load_config(environ={"SPECD_MODEL_DEVICE": name})
            return True
        except ConfigError:
            return False

    spellings = [f"{kind}{index}" for kind in (*DEVICE_TYPES, "tpu", "CUDA", "gpu")
                 for index in ("", ":0", ":1", ":12", ":01", ":-1", ": 0", ":x")]
    for name in spellings:
        assert not config_accepts(name) or torch_parses(name), name
    assert all(config_accepts(f"{kind}:{index}") for kind in DEVICE_TYPES for index in (0, 7))
    assert not any(config_accepts(name) for name in ("tpu", "CUDA", "gpu", "meta", "cuda:01", ""))


def test_relative_xdg_directories_are_ignored(monkeypatch, tmp_path):
    # The XDG base directory spec: a relative value is invalid and is ignored.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_RUNTIME_DIR", "run")
    monkeypatch.setenv("XDG_STATE_HOME", "state")
    monkeypatch.setenv("XDG_CONFIG_HOME", "config")
    cfg = load_config(environ={})
    assert cfg.socket_path == tmp_path / ".local" / "state" / "specd" / "run" / "specd.sock"
    assert config_path() == tmp_path / ".config" / "specd" / "config.toml"


def test_a_relative_config_file_is_handed_on_as_an_absolute_path(tmp_path, monkeypatch):
    # A daemon the client spawns runs in /, and gets the file's path in SPECD_CONFIG.
    (tmp_path / "c.toml").write_text("[engine]\nmax_tokens = 9\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={"SPECD_CONFIG": "c.toml"})
    assert cfg.file == tmp_path / "c.toml" and cfg["engine.max_tokens"] == 9


def test_the_daemon_refuses_an_out_of_range_port_given_past_the_config():
    # Daemon(tcp=...) bypasses load_config; bind_tcp applies the same rule in one line.
    from specd.daemon.listeners import StartupError, bind_tcp

    for spec, says in (("127.0.0.1:99999", "outside 1-65535"), ("127.0.0.1", "no port"),
                       ("0.0.0.0:7878", "not a loopback address")):
        with pytest.raises(StartupError, match=says) as info:
            bind_tcp(spec)
        assert "\n" not in str(info.value) and spec in str(info.value)
