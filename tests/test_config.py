"""Config: defaults < TOML < SPECD_* environment < flags; bad input is one clear line, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specd.config import ConfigError, config_path, load_config


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
    with pytest.raises(ConfigError, match="unknown config key 'engine.bogus'"):
        load_config(environ={"SPECD_ENGINE_BOGUS": "1"})


def test_cli_exit_code_2_and_one_line_on_broken_config():
    path = write_config("[engine]\nmax_tokenz = 3\n")
    proc = subprocess.run([sys.executable, "-m", "specd", "doctor", "--no-load"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "engine.max_tokenz" in proc.stderr and str(path) in proc.stderr
    assert "Traceback" not in proc.stderr
