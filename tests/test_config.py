"""Config: defaults < TOML < SPECD_* environment < flags; bad input is one clear line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specd.config import ConfigError, config_path, load_config, unknown_environment


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
