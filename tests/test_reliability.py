"""Reliability and security checks that the daemon, LSP and engine tests leave open.

- start-up faults on the production load path (no engine hook): a tokenizer mismatch, a corrupt
  or missing model directory, pickle-only weights, a repo that needs its own code, a config
  typo: one line naming the problem, a non-zero exit, in bounded time;
- out of memory inside the daemon's completion (prefill, verification, persistent): retried once
  with the caches evicted, the answer still the target's own, else a clear error, daemon alive;
- bad input over the socket: 100k-line files, documents over the limit, frames over the limit,
  documents never opened, cursors out of range;
- security: socket 0600 / directory 0700 whatever the umask, no TCP listener by default, nothing
  from a buffer or a workspace file is ever executed.

Figures (times, sizes) are printed; run with ``-s`` to see them (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from daemon_helpers import DaemonProcess, base_env, expect_error, raw_connect, read_all, wait_for
from specd.protocol import ErrorCode, RpcError, pack
from tiny import make_tiny_pair, make_tokenizer

STARTUP_LIMIT_S = 90.0  # "never a hang": generous for a loaded 2-core machine; typically ~5 s


def uri(name: str) -> str:
    return f"file:///work/reliability/{name}"


# -- start-up faults ------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _custom_code_model(src: Path, dst: Path, marker: Path) -> Path:
    """A model directory whose architecture exists only in its own Python file, which touches
    ``marker`` when imported."""
    _copy(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(model_type="evilllama", architectures=["EvilModel"],
                  auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('executed')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evilllama'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    return dst


def _bin_only(src: Path, dst: Path) -> Path:
    import torch
    from safetensors.torch import load_file

    _copy(src, dst)
    weights = dst / "model.safetensors"
    torch.save(load_file(weights), dst / "pytorch_model.bin")
    weights.unlink()
    return dst


def _truncated(src: Path, dst: Path) -> Path:
    _copy(src, dst)
    weights = dst / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return dst


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory, tiny_root):
    """{case: (target, draft)} model directories, each broken in one way."""
    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    work = tmp_path_factory.mktemp("broken-models")
    mismatch = _copy(draft, work / "draft-300")
    make_tokenizer(vocab_size=300).save_pretrained(mismatch)
    garbage = _copy(target, work / "garbage-config")
    (garbage / "config.json").write_text("{this is not json")
    no_config = _copy(target, work / "no-config")
    (no_config / "config.json").unlink()
    return {
        "tokenizer_mismatch": (target, mismatch),
        "config_json_garbage": (garbage, None),
        "no_config_json": (no_config, None),
        "truncated_safetensors": (_truncated(target, work / "truncated"), None),
        "pytorch_bin_only": (_bin_only(target, work / "bin-only"), None),
        "custom_code": (_custom_code_model(target, work / "custom", work / "EXECUTED-default"), None),
        "missing_target": (work / "no-such-target", None),
        "missing_draft": (target, work / "no-such-draft"),
        "_work": (work, None),
    }


# What the one line must name, per case.
LOAD_FAULTS = {
    "tokenizer_mismatch": ["use different tokenizers", "512 vs 300 tokens", "draft-300"],
    "config_json_garbage": ["garbage-config", "config.json", "not a valid JSON"],
    "no_config_json": ["no-config", "has no config.json"],
    "truncated_safetensors": ["cannot load target model", "truncated", "deserializ"],
    "pytorch_bin_only": ["cannot load target model", "bin-only", "model.safetensors"],
    "custom_code": ["cannot load target model", "custom", "custom code"],
    "missing_target": ["target model directory", "no-such-target", "does not exist"],
    "missing_draft": ["draft model directory", "no-such-draft", "does not exist"],
}


@pytest.mark.parametrize("case", sorted(LOAD_FAULTS))
def test_model_load_fault_is_one_line_naming_it(broken_models, case):
    """The loader the daemon uses turns each fault into one ModelLoadError line naming the
    problem and the directory (the daemon prints it as `specd: cannot load models: <line>`)."""
    from specd.engine.models import load_pair
    from specd.engine.types import ModelLoadError

    target, draft = broken_models[case]
    started = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load_pair(str(target), str(draft) if draft else None, "cpu", "float32")
    message = str(info.value)
    assert "\n" not in message.strip()
    for fragment in LOAD_FAULTS[case]:
        assert fragment in message, message
    print(f"\n{case}: {time.monotonic() - started:.2f} s: {message}")


@pytest.fixture(scope="module")
def startup_runs(broken_models):
    """`specd serve` on the production load path (no engine hook) for a few faults, all at once
    (each pays a torch import). Yields {case: (returncode, seconds, stderr, socket_path)}, plus
    the trust_remote_code=True control's return code."""
    work = broken_models["_work"][0]
    target = broken_models["missing_draft"][0]
    cases = {
        "tokenizer_mismatch": ({"model.target": target, "model.draft": broken_models["tokenizer_mismatch"][1]}, None),
        "truncated_safetensors": ({"model.target": broken_models["truncated_safetensors"][0]}, None),
        "custom_code": ({"model.target": broken_models["custom_code"][0]}, None),
        "config_typo": ({"model.target": target}, "[engine]\nmax_tokenz = 3\n"),
    }
    procs = {}
    for name, (config, toml) in cases.items():
        d = DaemonProcess(work / f"serve-{name}", config={**config, "model.device": "cpu"})
        d.env.pop("SPECD_TEST_ENGINE_FACTORY")  # the production load path
        if toml is not None:
            path = Path(d.env["XDG_CONFIG_HOME"]) / "specd" / "config.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(toml)
        d.start(wait=False)
        procs[name] = d
    # The control for custom_code: with trust_remote_code on, the same kind of repo's code does
    # run, so the marker check of the default-off case would notice if it ran.
    trusted = _custom_code_model(target, work / "custom-trusted", work / "EXECUTED-trusted")
    env = base_env(work / "trusted-env", extra={"HF_MODULES_CACHE": str(work / "hf-modules")})
    control = subprocess.Popen(
        [sys.executable, "-c", "import sys; from specd.engine.models import load_pair; "
                               "load_pair(sys.argv[1], None, 'cpu', 'float32', trust_remote_code=True)", str(trusted)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    finished: dict[str, float] = {}
    try:
        while len(finished) < len(procs) and time.monotonic() - started < STARTUP_LIMIT_S:
            for name, d in procs.items():
                if name not in finished and d.proc.poll() is not None:
                    finished[name] = time.monotonic() - started
            time.sleep(0.05)
        control.wait(max(1.0, STARTUP_LIMIT_S - (time.monotonic() - started)))
    finally:
        for d in procs.values():
            d.kill()
        if control.poll() is None:
            control.kill()
    results = {name: (d.proc.returncode if name in finished else None, finished.get(name), d.stderr(), d.socket_path)
               for name, d in procs.items()}
    results["_control"] = control.returncode
    yield results


@pytest.mark.slow
@pytest.mark.parametrize("case, exit_code, fragments", [
    ("tokenizer_mismatch", 1, ["cannot load models", "use different tokenizers", "draft-300"]),
    ("truncated_safetensors", 1, ["cannot load models", "cannot load target model", "truncated"]),
    ("custom_code", 1, ["cannot load models", "custom code"]),
    ("config_typo", 2, ["engine.max_tokenz", "config.toml"]),
])
def test_serve_with_a_fault_exits_nonzero_with_one_line_and_never_hangs(startup_runs, case, exit_code, fragments):
    code, seconds, stderr, socket_path = startup_runs[case]
    assert code is not None, f"{case}: still running after {STARTUP_LIMIT_S} s:\n{stderr}"
    assert code == exit_code, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("specd:")]
    assert len(lines) == 1, stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in stderr
    assert not socket_path.exists()
    print(f"\nserve {case}: exit {code} after {seconds:.1f} s (4 started at once): {lines[0]}")


@pytest.mark.slow
def test_models_need_safetensors_and_never_run_repo_code_by_default(broken_models, startup_runs):
    """trust_remote_code is off unless configured: the repo's own module was never imported (its
    marker file is absent), while the control with trust_remote_code=True did import it. Weights
    load from safetensors only (use_safetensors=True): a pickle-only directory is refused."""
    from specd.config import load_config

    work = broken_models["_work"][0]
    assert load_config(environ={})["model.trust_remote_code"] is False
    assert startup_runs["custom_code"][0] == 1
    assert not (work / "EXECUTED-default").exists()
    assert startup_runs["_control"] == 0
    assert (work / "EXECUTED-trusted").read_text() == "executed"


# -- out of memory inside the daemon --------------------------------------------------------------


@pytest.fixture(scope="module")
def oom_daemon(tmp_path_factory, tiny_root):
    """The real engine on the tiny llama pair, with default document and frame limits, and a hook
    that raises torch's OOM error inside the target's forward when a plan file says so."""
    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    root = tmp_path_factory.mktemp("oom-daemon")
    plan = root / "oom-plan.json"
    config = {"model.target": target, "model.draft": draft, "model.device": "cpu",
              "engine.max_tokens": 8, "engine.time_budget_ms": 30000}
    d = DaemonProcess(root, config=config, env={"SPECD_TEST_ENGINE_FACTORY": "oom_engine:real_with_oom",
                                                "SPECD_TEST_OOM_PLAN": str(plan)})
    d.plan = plan
    d.start(timeout=120)
    yield d
    d.stop()


OOM_TEXT = ("def scale(values, factor):\n    out = []\n    for v in values:\n        out.append(v * factor)\n"
            "    return out\n\n\ndef shift(values, delta):\n    out = []\n    for v in values:\n        ")
PLAIN = {"use_draft_model": True, "use_lookup": True, "stop_at_block_end": False, "single_line": False}


def _complete_fresh(client, name: str, text: str = OOM_TEXT) -> dict:
    u = uri(name)
    client.open_document(u, text)
    try:
        return client.complete(uri=u, cursor=len(text), options=PLAIN)
    finally:
        client.close_document(u)


@pytest.mark.parametrize("phase, plan", [("prefill", [1]), ("verification", [2])])
def test_oom_in_the_daemon_is_retried_once_and_the_answer_is_unchanged(oom_daemon, phase, plan):
    with oom_daemon.client() as client:
        reference = _complete_fresh(client, f"reference-{phase}.py")
        assert reference["target_forwards"] >= 2, reference  # a verification pass happened
        before = client.status()["engine"]
        oom_daemon.plan.write_text(json.dumps({"fail": plan}))
        started = time.monotonic()
        result = _complete_fresh(client, f"oom-{phase}.py")
        seconds = time.monotonic() - started
        after = client.status()["engine"]
    assert not oom_daemon.plan.exists()  # the plan was consumed by that completion
    assert after["injected_ooms"] == before["injected_ooms"] + 1
    assert after["oom_retries"] == before["oom_retries"] + 1
    # The retry ran on evicted caches, not on the half-written one: the answer is the target's own.
    assert result["token_ids"] == reference["token_ids"] and result["text"] == reference["text"]
    print(f"\nOOM in {phase}: retried once, same {len(result['token_ids'])} tokens, answered in {seconds * 1000:.0f} ms")


def test_oom_that_persists_is_a_clear_error_and_the_daemon_keeps_serving(oom_daemon):
    with oom_daemon.client() as client:
        before = client.status()["engine"]
        oom_daemon.plan.write_text(json.dumps({"fail": "all"}))
        u = uri("oom-always.py")
        client.open_document(u, OOM_TEXT)
        err = expect_error(ErrorCode.ENGINE_ERROR, client.complete, uri=u, cursor=len(OOM_TEXT), options=PLAIN)
        assert "out of memory" in err.message and "\n" not in err.message
        after = client.status()
        assert after["state"] == "ready"
        assert after["engine"]["oom_retries"] == before["oom_retries"] + 1
        assert after["engine"]["injected_ooms"] == before["injected_ooms"] + 2  # first try and the retry
        # The same document, next request: served normally.
        result = client.complete(uri=u, cursor=len(OOM_TEXT), options=PLAIN)
        assert result["token_ids"] and result["stop_reason"]
        client.close_document(u)
    assert oom_daemon.proc.poll() is None
    print(f"\npersistent OOM: error {err.code}: {err.message}")


# -- bad input over the socket --------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_daemon(tmp_path_factory):
    """The model-free engine with the default limits (8 MiB documents, 16 MiB frames)."""
    d = DaemonProcess(tmp_path_factory.mktemp("plain-daemon")).start()
    yield d
    d.stop()


HUNDRED_K = "".join(f"value_{n} = compute({n}, 'x')  # line {n}\n" for n in range(100_000))


def test_a_100k_line_file_is_opened_edited_and_served(plain_daemon):
    u = uri("huge.py")
    with plain_daemon.client() as client:
        started = time.monotonic()
        client.open_document(u, HUNDRED_K, version=1)
        opened = time.monotonic() - started
        timings = {}
        for line in (0, 50_000, 99_999):
            started = time.monotonic()
            result = client.complete(uri=u, cursor={"line": line, "character": 8})
            timings[line] = time.monotonic() - started
            offset = HUNDRED_K.index(f"value_{line} =") + 8
            assert result["offset"] == offset and result["text"] == f"[{HUNDRED_K[max(0, offset - 12):offset]}]"
        started = time.monotonic()
        client.change_document(u, 2, edits=[{"range": {"start": {"line": 99_999, "character": 0},
                                                       "end": {"line": 99_999, "character": 5}}, "text": "VALUE"}])
        edited = time.monotonic() - started
        result = client.complete(uri=u, cursor={"line": 99_999, "character": 7})
        assert result["version"] == 2 and result["text"].endswith("VALUE_9]")
        client.close_document(u)
        assert client.status()["documents"]["open"] == 0
    size = len(HUNDRED_K.encode()) / 2**20
    print(f"\n100k lines ({size:.1f} MiB): open {opened * 1000:.0f} ms, complete at lines 0/50k/100k "
          + "/".join(f"{t * 1000:.0f}" for t in timings.values()) + f" ms, ranged edit {edited * 1000:.0f} ms")


def test_a_100k_line_file_through_the_real_engine(oom_daemon):
    """The real engine keeps a window of the document near the cursor: a 4.5 MiB file is served in
    bounded time and the daemon stays responsive."""
    u = uri("huge-real.py")
    with oom_daemon.client() as client:
        client.open_document(u, HUNDRED_K)
        started = time.monotonic()
        result = client.complete(uri=u, cursor={"line": 99_999, "character": 8}, options={"max_tokens": 4})
        first = time.monotonic() - started
        started = time.monotonic()
        client.complete(uri=u, cursor={"line": 99_999, "character": 9}, options={"max_tokens": 4})
        second = time.monotonic() - started
        assert result["token_ids"] and client.status()["state"] == "ready"
        client.close_document(u)
    assert first < 60
    print(f"\n100k lines, real engine: first complete {first:.1f} s, next {second * 1000:.0f} ms")


def test_oversize_documents_and_frames_get_clear_errors_and_lose_nothing(plain_daemon):
    keep = uri("keep.py")
    with plain_daemon.client() as client:
        client.open_document(keep, "keep = 1\n")
        big = "x" * (8 * 1024 * 1024 + 1)  # one byte over the default daemon.max_document_bytes
        err = expect_error(ErrorCode.DOCUMENT_TOO_LARGE, client.open_document, uri("big.py"), big)
        assert "daemon.max_document_bytes" in err.message
        err = expect_error(ErrorCode.DOCUMENT_TOO_LARGE, client.complete, text=big, cursor=1)
        # Growing a document past the limit by edits is refused too, and the document is unchanged.
        half = "y" * (5 * 1024 * 1024)
        client.change_document(keep, 1, text=half)
        expect_error(ErrorCode.DOCUMENT_TOO_LARGE, client.change_document, keep, 2,
                     edits=[{"start": 0, "end": 0, "text": half}])
        assert client.complete(uri=keep, cursor=3)["version"] == 1
        # A frame over daemon.max_frame_bytes (16 MiB) closes that connection only.
        with raw_connect(plain_daemon.socket_path) as sock:
            try:
                sock.sendall(pack([0, 1, "open", [{"uri": "u", "text": "z" * (17 * 1024 * 1024)}]]))
            except (BrokenPipeError, ConnectionResetError):
                pass
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(read_all(sock))
            replies = list(unpacker)
        assert replies and replies[-1][1] == "specd/error" and replies[-1][2][0]["code"] == "frame_too_large"
        assert client.complete(uri=keep, cursor=3)["text"] == "[yyy]"
        client.close_document(keep)
    assert plain_daemon.proc.poll() is None


def test_documents_never_opened(plain_daemon):
    never = uri("never-opened.py")
    with plain_daemon.client() as client:
        expect_error(ErrorCode.UNKNOWN_DOCUMENT, client.complete, uri=never, cursor=0)
        expect_error(ErrorCode.UNKNOWN_DOCUMENT, client.complete, uri=never, cursor={"line": 0, "character": 0})
        expect_error(ErrorCode.UNKNOWN_DOCUMENT, client.change_document, never, 1, text="x")
        expect_error(ErrorCode.UNKNOWN_DOCUMENT, client.change_document, never, 1,
                     edits=[{"start": 0, "end": 0, "text": "x"}])
        try:  # closing an unknown document is either a no-op or a coded error, never a crash
            answer = client.close_document(never)
            assert answer["closed"] is False, answer
        except RpcError as err:
            assert err.code == ErrorCode.UNKNOWN_DOCUMENT.value
        client.cancel(uri=never)  # nothing to cancel: answered, no error
        u = uri("opened-then-closed.py")
        client.open_document(u, "abc")
        client.close_document(u)
        expect_error(ErrorCode.UNKNOWN_DOCUMENT, client.complete, uri=u, cursor=1)
        assert client.hello()["server"] == "specd"


OUT_OF_RANGE_CURSORS = [
    -1, 7, 2**31, 2**63 - 1, -(2**63),
    {"line": -1, "character": 0}, {"line": 0, "character": -1}, {"line": 2, "character": 0},
    {"line": 2**40, "character": 0},
]
MALFORMED_CURSORS = [
    "3", 1.5, True, None, [], [0, 1], {"line": 0}, {"character": 0}, {"line": "0", "character": 0},
    {"line": 0, "character": 1.0}, {"line": None, "character": None},
]


def test_out_of_range_and_malformed_cursors(plain_daemon):
    """Each bad cursor, on an open document and on stateless text: out_of_range or invalid_params
    naming the problem. A character past the end of its line is clamped to the line's end, as LSP
    specifies."""
    u = uri("cursor-range.py")
    text = "abc\ndé"  # 6 characters, 2 lines
    with plain_daemon.client() as client:
        client.open_document(u, text)
        for where in ({"uri": u}, {"text": text}):
            for cursors, code in ((OUT_OF_RANGE_CURSORS, ErrorCode.OUT_OF_RANGE),
                                  (MALFORMED_CURSORS, ErrorCode.INVALID_PARAMS)):
                for cursor in cursors:
                    err = expect_error(code, client.complete, cursor=cursor, **where)
                    assert "cursor" in err.message or "offset" in err.message or "line" in err.message \
                        or "character" in err.message, err.message
            clamped = client.complete(cursor={"line": 0, "character": 2**40}, **where)
            assert clamped["offset"] == 3 and clamped["text"] == "[abc]"
        assert client.complete(uri=u, cursor={"line": 1, "character": 2})["text"] == "[abc\ndé]"
        client.close_document(u)
    assert plain_daemon.proc.poll() is None
    print(f"\n{2 * len(OUT_OF_RANGE_CURSORS)} out-of-range and {2 * len(MALFORMED_CURSORS)} malformed cursors: coded errors")


# -- security -------------------------------------------------------------------------------------


def _listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":  # TCP_LISTEN
                inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def test_no_tcp_listener_by_default_and_the_check_sees_a_configured_one(plain_daemon, tmp_path):
    own = _socket_inodes(plain_daemon.pid)
    assert own, "the daemon holds its Unix socket at least"
    assert not own & _listening_tcp_inodes()
    # Control: the same check finds the listener when one is configured.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = DaemonProcess(tmp_path / "tcp", config={"daemon.tcp_token": "t0ken"}, args=("--tcp", f"127.0.0.1:{port}")).start()
    try:
        assert _socket_inodes(d.pid) & _listening_tcp_inodes()
    finally:
        d.stop()


def test_socket_0600_and_directory_0700_whatever_the_umask(tmp_path):
    d = DaemonProcess(tmp_path / "d")
    run_dir = d.socket_path.parent
    old = os.umask(0)
    try:
        d.start(preexec_fn=lambda: os.umask(0))
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(d.socket_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert d.socket_path.stat().st_uid == os.getuid()
    finally:
        d.stop()


def test_a_shared_socket_directory_is_refused_not_repaired(tmp_path):
    """A pre-existing world-writable directory is not ours to chmod (it may be /tmp, or what a
    planted symlink points at): one line, exit 2 (the surroundings to change), the directory
    left as it was."""
    d = DaemonProcess(tmp_path / "d")
    run_dir = d.socket_path.parent
    run_dir.mkdir(parents=True, mode=0o755)
    os.chmod(run_dir, 0o777)
    d.start(wait=False)
    assert d.proc.wait(30) == 2
    lines = [line for line in d.stderr().splitlines() if line.startswith("specd:")]
    assert len(lines) == 1 and "mode 0777" in lines[0] and "chmod 700" in lines[0], d.stderr()
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o777
    assert not d.socket_path.exists()


PAYLOADS = [
    "__import__('os').system('touch {m}')\n",
    "import os\nos.system('touch {m}')\n",
    "exec(\"open('{m}', 'w').write('x')\")\n",
    "eval(compile(\"open('{m}', 'w')\", 'x', 'exec'))\n",
    "import subprocess; subprocess.run(['touch', '{m}'])\n",
    "#!/bin/sh\ntouch {m}\n$(touch {m})\n`touch {m}`\n",
    "{{{{ __import__('os').system('touch {m}') }}}}\n${{touch {m}}}\n",
    "<|fim_prefix|>__import__('os').system('touch {m}')<|fim_middle|><|endoftext|>\n",
    "import pickle; pickle.loads(b\"cos\\nsystem\\n(S'touch {m}'\\ntR.\")\n",
]


def test_nothing_from_a_buffer_or_a_workspace_file_is_executed(oom_daemon, tmp_path):
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    markers = []
    for n, payload in enumerate(PAYLOADS):
        markers.append(marker_dir / f"buffer{n}")
        markers.append(marker_dir / f"file{n}")
    # Files Python or tools would run on their own: setup.py, conftest.py, a .pth, __init__.py.
    for n, name in enumerate(("setup.py", "conftest.py", "evil.pth", "pkg/__init__.py", "Makefile", "run.sh")):
        path = workspace / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(PAYLOADS[n].format(m=marker_dir / f"file{n}"))
    with oom_daemon.client() as client:
        client.workspace([workspace.as_uri()])
        wait_for(lambda: client.status()["workspace"]["files"] >= 3, 20, message="the workspace scan")
        for n, payload in enumerate(PAYLOADS):
            text = "x = 1\n" + payload.format(m=marker_dir / f"buffer{n}") + "y = 2\n"
            u = uri(f"payload{n}.py")
            client.open_document(u, text)
            for cursor in (0, 6, len(text) // 2, len(text)):
                client.complete(uri=u, cursor=cursor, options={"max_tokens": 4})
            client.complete(text=text, cursor=len(text) - 6, options={"max_tokens": 4})
            client.close_document(u)
        client.workspace([])
    time.sleep(0.5)
    assert not [m.name for m in marker_dir.iterdir()]
    assert oom_daemon.proc.poll() is None


def test_invalid_utf8_on_disk_in_the_workspace(oom_daemon, tmp_path):
    """Files that are not UTF-8 (Latin-1 text, a stray 0xff byte) are skipped as binary, a file
    whose *name* is not UTF-8 is indexed or skipped but never breaks the scan or the socket, and
    completions go on."""
    workspace = tmp_path / "ws-bytes"
    workspace.mkdir()
    (workspace / "good.py").write_text("def good():\n    return 1\n")
    (workspace / "latin1.py").write_bytes("caf\xe9 = 'na\xefve'\n".encode("latin-1"))
    (workspace / "stray.py").write_bytes(b"x = 1\n\xff\xfe y = 2\n")
    (workspace / "half-emoji.py").write_bytes("s = '😀'\n".encode()[:-3] + b"\n")
    with open(os.path.join(os.fsencode(workspace), b"caf\xe9-name.py"), "wb") as odd:
        odd.write(b"def odd_name():\n    return 2\n")
    with oom_daemon.client() as client:
        client.workspace([workspace.as_uri()])
        status = wait_for(lambda: (s := client.status())["workspace"]["skipped"].get("binary", 0) >= 3 and s,
                          20, message="the workspace scan")
        assert status["workspace"]["files"] in (1, 2), status["workspace"]  # good.py (+ the odd name)
        result = client.complete(text="def good():\n    return ", cursor=23, options={"max_tokens": 4})
        assert result["stop_reason"] and result["offset"] == 23
        client.workspace([])
    assert oom_daemon.proc.poll() is None
    print(f"\ninvalid UTF-8 workspace: {status['workspace']['files']} indexed, skipped {status['workspace']['skipped']}")
