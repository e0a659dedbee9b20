"""The remote backend against a real server: llama-cpp-python's OpenAI-compatible server on
loopback, serving the demo pair's target as GGUF (the same weights and token ids as the local
engine), with specd's daemon and specd-lsp in front of it.

That server takes prompts only as strings, so specd's ``auto`` prompt mode falls back to text
there; the tests check that the server tokenizes that text to exactly the ids specd built, and
that the completion is what llama.cpp writes for those ids. The token-id path, malformed streams
and a silent server are checked against a small scripted HTTP server (no real server produces
them on purpose).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from daemon_helpers import REPO, DaemonProcess, free_port, wait_for
from lsp_helpers import daemon_options, link_options, lsp_session, server_env
from test_lsp_nvim import nvim  # noqa: F401  (the fixture: a Neovim with vim.lsp.inline_completion)
from specd.client import Client
from specd.demo import demo_pair_paths
from specd.engine.remote import engine as remote
from specd.engine import load_engine
from specd.engine.remote.client import RemoteOptions, completions_url
from specd.engine.remote.engine import RemoteEngine
from specd.engine.types import Cancelled, CompletionRequest, EngineError
from specd.protocol import RpcError
from specd_lsp.completion import context_at, postprocess
from specd_lsp.positions import TextIndex

KEY = "test-key"
URI = "file:///work/remote_sample.py"
MAX_TOKENS = 24
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "stop_at_block_end": False, "time_budget_ms": 60_000}
LLAMA_CPP_GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0, "top_k": 0}


class LlamaServer:
    """``python -m llama_cpp.server`` on loopback (one thread, as the tests' other processes)."""

    def __init__(self, gguf: Path, log: Path, port: int | None = None, api_key: str = KEY):
        self.gguf, self.log, self.api_key = gguf, log, api_key
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "LlamaServer":
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--host", "127.0.0.1",
                 "--port", str(self.port), "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", "4096",
                 "--api_key", self.api_key], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"llama_cpp.server exited with {self.proc.returncode}:\n"
                                     f"{self.log.read_text()[-3000:]}")
            try:
                return self.get("/v1/models")
            except OSError:
                return None

        wait_for(up, timeout, 0.1, "llama_cpp.server to answer")
        return self

    def _request(self, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {self.api_key}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def get(self, path: str) -> dict:
        return self._request(path)

    def post(self, path: str, body: dict) -> dict:
        return self._request(path, body)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def remote_config(url: str, api_key: str = KEY, **extra) -> dict:
    return {"model.backend": "remote", "model.remote_url": url, "model.remote_api_key": api_key,
            "engine.max_tokens": MAX_TOKENS, "engine.time_budget_ms": 60_000, "log.level": "debug", **extra}


def real_daemon(root: Path, config: dict) -> DaemonProcess:
    """The daemon as users run it: no test engine hook, the engine from the config."""
    return DaemonProcess(root, config=config, env={"SPECD_TEST_ENGINE_FACTORY": ""})


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    from specd.llamacpp.export import cached_gguf

    return cached_gguf(demo_pair_paths()[0], directory=tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def server(gguf, tmp_path_factory):
    proc = LlamaServer(gguf, tmp_path_factory.mktemp("server") / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def daemon(server, tmp_path_factory):
    proc = real_daemon(tmp_path_factory.mktemp("remote-daemon"), remote_config(server.url))
    proc.start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def source() -> str:
    return (Path(__file__).parent / "data" / "sample_module.py").read_text(encoding="utf-8")


def cursor_in_body(text: str, nth: int = 0) -> int:
    """Just after the ``nth`` ``return`` keyword's line indent: a place a model completes."""
    at = -1
    for _ in range(nth + 1):
        at = text.index("    return ", at + 1)
    return at + len("    return ")


def one_line(message: str) -> str:
    assert "\n" not in message and message.startswith("remote backend: "), message
    return message


# -- completions ----------------------------------------------------------------------------------


def test_a_completion_is_what_the_server_writes_for_specds_prompt_ids(daemon, server, gguf, source):
    from specd.llamacpp.runtime import load_llama

    offset = cursor_in_body(source)
    with daemon.client() as client:
        client.open_document(URI, source)
        got = client.complete(uri=URI, cursor={"offset": offset}, options=GREEDY)
    assert got["stop_reason"] in ("eos", "max_tokens") and got["text"], got
    ids = got["prompt_ids"]
    prompt_text = _tokenizer().decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    # The server sees exactly the ids specd built ...
    assert server.post("/extras/tokenize", {"input": prompt_text})["tokens"] == ids
    # ... and writes, for them, what specd returned.
    served = server.post("/v1/completions", {"prompt": prompt_text, "max_tokens": MAX_TOKENS, **LLAMA_CPP_GREEDY})
    assert served["choices"][0]["text"] == got["text"]
    # llama.cpp itself, given the ids (not text), agrees.
    direct = load_llama(gguf, n_ctx=4096).create_completion(prompt=ids, max_tokens=MAX_TOKENS, **LLAMA_CPP_GREEDY)
    assert direct["choices"][0]["text"] == got["text"]


def test_the_prompt_is_the_local_engines_prompt(daemon, source):
    """The same builder, template, layout and windows as the local engine, healing off."""
    from specd.engine.options import EngineOptions, context_window, fit_prompt_budget
    from specd.engine.models import load_tokenizer
    from specd.engine.front.prompt import PromptBuilder, detect_family

    target = str(demo_pair_paths()[0])
    offset = cursor_in_body(source, 2)
    with daemon.client() as client:
        got = client.complete(text=source, cursor={"offset": offset}, options=GREEDY)  # no uri: no context chunks
    tokenizer = load_tokenizer(target)
    options = EngineOptions(max_tokens=MAX_TOKENS)  # as the daemon is configured: it sizes the windows
    builder = PromptBuilder(tokenizer, detect_family(tokenizer, target),
                            *fit_prompt_budget(options.prefix_tokens, options.suffix_tokens, options.context_tokens,
                                               context_window(target), options.max_tokens))
    assert got["prompt_ids"] == builder.build(source, offset, heal=False).ids


@pytest.mark.slow
def test_status_and_doctor_name_the_remote_backend_and_its_latency(daemon, server):
    with daemon.client() as client:
        client.complete(text="def f():\n    return ", cursor={"offset": 20}, options=GREEDY)
        info = client.status()
    engine = info["engine"]
    assert engine["backend"] == "remote" and engine["remote"]["url"] == server.url + "/v1/completions"
    assert engine["remote"]["first_token_ms"]["count"] >= 1 and engine["remote"]["prompt"] == "text"
    assert info["device"].startswith(f"remote {server.url}/v1/completions (first token p50 ")
    shown = subprocess.run([sys.executable, "-m", "specd", "status"], env=daemon.env, cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and f"remote {server.url}" in shown.stdout and "first token p50" in shown.stdout
    doctor = subprocess.run([sys.executable, "-m", "specd", "doctor"], env=daemon.env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert f"backend:     remote ({server.url})" in doctor.stdout and "first token" in doctor.stdout
    assert KEY not in doctor.stdout  # the key is masked


# -- cancel and supersede -------------------------------------------------------------------------


def _complete_in_thread(client: Client, **kwargs):
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = client.complete(**kwargs)
        except RpcError as err:
            outcome["error"] = err
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _running(client: Client, outcome: dict):
    assert "at" not in outcome, f"the request ended early: {outcome}"
    return client.status()["requests"]["running"]


def test_cancel_and_supersede_close_the_stream_at_once_even_from_a_frozen_server(daemon, server, source):
    """The server is stopped (SIGSTOP) so the request is surely in flight: cancel must not wait
    for it; a newer request on the same document supersedes the older one."""
    offset = cursor_in_body(source, 1)
    with daemon.client() as control, daemon.client() as first, daemon.client() as second:
        server.signal(signal.SIGSTOP)
        try:
            request = {"uri": URI, "text": source, "cursor": {"offset": offset}, "options": GREEDY}
            thread, outcome = _complete_in_thread(first, **request)
            wait_for(lambda: _running(control, outcome), 10, message="the request to reach the worker")
            asked = time.monotonic()
            assert control.cancel(uri=URI)["cancelled"] == 1
            thread.join(5)
            assert outcome["error"].code == "cancelled" and outcome["at"] - asked < 1.0
            thread, older = _complete_in_thread(first, **request)
            wait_for(lambda: _running(control, older), 10, message="the older request to run")
            newer_thread, newer = _complete_in_thread(second, **request)
            thread.join(5)
            assert older["error"].code == "cancelled" and "superseded" in older["error"].message
        finally:
            server.signal(signal.SIGCONT)
        newer_thread.join(120)
        assert newer["result"]["text"] and newer["result"]["stop_reason"] in ("eos", "max_tokens")
    info = daemon.wait_ready()
    assert info["engine"]["remote"]["cancelled"] >= 2


def test_cancel_mid_stream_closes_it_and_the_server_serves_on(server, source, monkeypatch):
    engine = load_engine(_cfg(remote_config(server.url)))
    request = CompletionRequest(text=source, offset=cursor_in_body(source), **GREEDY)
    whole = engine.complete(request)
    cancel = threading.Event()
    chunks = []
    real_event_text = remote.event_text

    def cancel_after_first(event):
        chunks.append(event)
        cancel.set()  # the user typed on
        return real_event_text(event)

    monkeypatch.setattr(remote, "event_text", cancel_after_first)
    with pytest.raises(Cancelled):
        engine.complete(request, cancel)
    assert len(chunks) == 1
    monkeypatch.setattr(remote, "event_text", real_event_text)
    assert engine.complete(request).text == whole.text
    assert engine.stats()["remote"]["cancelled"] == 1


# -- failures -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_refused_connection_a_killed_server_and_its_return(gguf, tmp_path):
    server = LlamaServer(gguf, tmp_path / "server.log")
    daemon = real_daemon(tmp_path / "daemon", remote_config(server.url, **{"model.remote_read_timeout_ms": 30_000}))
    daemon.start(timeout=120)
    try:
        with daemon.client() as client:
            request = {"text": "def f():\n    return ", "cursor": {"offset": 20}, "options": GREEDY}
            with pytest.raises(RpcError) as refused:
                client.complete(**request)
            assert one_line(refused.value.message) == (
                f"remote backend: cannot reach {server.url}: connection refused; is the server running?")
            server.start()
            assert client.complete(**request)["text"]
            # Killed mid-request: frozen first so the request is surely in flight, then killed.
            server.signal(signal.SIGSTOP)
            thread, outcome = _complete_in_thread(client, **request)
            with daemon.client() as control:
                wait_for(lambda: _running(control, outcome), 10, message="the request to run")
            killed = time.monotonic()
            server.kill()
            thread.join(10)
            assert outcome["at"] - killed < 2.0, "the daemon answers as soon as the server is gone"
            assert outcome["error"].code == "engine_error"
            assert one_line(outcome["error"].message).startswith(f"remote backend: cannot reach {server.url}")
            assert client.status()["state"] == "ready"
            with pytest.raises(RpcError) as down:
                client.complete(**request)
            assert "connection refused" in down.value.message
            server.start()  # back, on the same port: the next request is served
            assert client.complete(**request)["text"]
            info = client.status()
            assert info["engine"]["remote"]["failed"] == 3 and info["engine"]["remote"]["last_error"] is None
    finally:
        daemon.stop()
        server.stop()


def test_a_server_killed_mid_stream_is_one_line_and_the_next_request_reconnects(gguf, tmp_path, source, monkeypatch):
    server = LlamaServer(gguf, tmp_path / "server.log").start()
    try:
        engine = load_engine(_cfg(remote_config(server.url)))
        request = CompletionRequest(text=source, offset=cursor_in_body(source), **GREEDY)
        whole = engine.complete(request)
        real_event_text = remote.event_text

        def kill_after_first(event):
            server.kill()  # gone after the first token: the rest of the stream never comes
            return real_event_text(event)

        monkeypatch.setattr(remote, "event_text", kill_after_first)
        with pytest.raises(EngineError) as lost:
            engine.complete(request)
        assert one_line(str(lost.value)).startswith(f"remote backend: {server.url} closed the stream mid-completion")
        monkeypatch.setattr(remote, "event_text", real_event_text)
        server.start()
        assert engine.complete(request).text == whole.text
    finally:
        server.stop()


@pytest.mark.slow
def test_a_wrong_api_key_is_one_line_through_the_daemon_and_specd_lsp(server, tmp_path):
    daemon = real_daemon(tmp_path / "daemon", remote_config(server.url, api_key="not-the-key"))
    daemon.start(timeout=120)
    try:
        with daemon.client() as client:
            with pytest.raises(RpcError) as refused:
                client.complete(text="x = ", cursor={"offset": 4}, options=GREEDY)
            assert one_line(refused.value.message) == (
                f"remote backend: {server.url} answered 401 Unauthorized: the API key was refused; "
                "check model.remote_api_key")
            assert client.status()["state"] == "ready"
            assert client.status()["engine"]["remote"]["last_error"] == refused.value.message

        async def editor():
            async with lsp_session(server_env(tmp_path / "lsp"), link_options(daemon)) as session:
                session.open(URI, "x = ")
                assert await session.inline(URI, 0, 4) == []
                assert (await session.status())["failed"] == 1

        import asyncio

        asyncio.run(editor())
    finally:
        daemon.stop()


# -- the editor -----------------------------------------------------------------------------------


def test_specd_lsp_completes_through_the_remote_backend(daemon, source, tmp_path):
    import asyncio

    lines = source.split("\n")
    line = next(i for i, text in enumerate(lines) if text.startswith("    return "))
    character = len("    return ")
    offset = TextIndex(source).offset(line, character)

    async def editor():
        async with lsp_session(server_env(tmp_path / "lsp"), link_options(daemon)) as session:
            session.open(URI + "?lsp", source)
            items = await session.inline(URI + "?lsp", line, character)
            with daemon.client() as client:
                raw = client.complete(uri=URI + "?lsp", text=source, cursor={"offset": offset},
                                      options=daemon_options())
            want = postprocess(raw["text"], context_at(source, offset))
            assert want is not None, raw
            assert [item.insert_text for item in items] == [want.insert_text]
            assert session.messages == []

    asyncio.run(editor())


@pytest.mark.slow
def test_neovim_shows_and_accepts_a_suggestion_from_the_remote_backend(nvim, daemon, server, tmp_path):  # noqa: F811
    """Headless Neovim 0.12 (vim.lsp.inline_completion) through specd-lsp and the daemon to the
    server: the ghost text is the server's completion for specd's prompt ids, post-processed."""
    from test_lsp_nvim import CANDIDATE_LINES, DOC, NVIM_DIR, _expected

    source = tmp_path / "greet.py"
    source.write_text(DOC, encoding="utf-8")
    index = TextIndex(DOC)
    line = offset = expected = None
    for line in CANDIDATE_LINES:
        offset = index.line_end(line)
        expected = _expected(daemon, source.as_uri(), DOC, offset)
        if expected is not None:
            break
    assert expected is not None, "the demo model completes none of the candidate lines"
    out = tmp_path / "result.json"
    env = {**os.environ, "SPECD_TEST_NVIM_FILE": str(source), "SPECD_TEST_NVIM_LINE": str(line + 1),
           "SPECD_TEST_NVIM_SOCKET": str(daemon.socket_path), "SPECD_TEST_NVIM_PYTHON": sys.executable,
           "SPECD_TEST_NVIM_LOG": str(tmp_path / "specd-lsp.log"), "SPECD_TEST_NVIM_OUT": str(out)}
    done = subprocess.run([nvim, "--headless", "--clean", "-c", f"luafile {NVIM_DIR / 'inline_completion.lua'}"],
                          env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert out.exists(), f"nvim wrote no result (exit {done.returncode}):\n{done.stderr}"
    result = json.loads(out.read_text())
    assert result.get("error") is None and result["steps"][-1] == "done", result
    assert result["ghost"] == expected.insert_text
    # The server itself, given the prompt specd built for that cursor, writes the same text.
    with daemon.client() as client:
        got = client.complete(uri=source.as_uri(), text=DOC, cursor={"offset": offset}, options=daemon_options())
    prompt_text = _tokenizer().decode(got["prompt_ids"], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    served = server.post("/v1/completions", {"prompt": prompt_text, "max_tokens": daemon_options()["max_tokens"],
                                             **LLAMA_CPP_GREEDY})["choices"][0]["text"]
    assert postprocess(got["text"], context_at(DOC, offset)).insert_text == expected.insert_text
    assert served.startswith(got["text"])  # the daemon may cut it sooner (end of the block)
    accepted = DOC[:offset] + expected.insert_text + DOC[offset + expected.replace_chars:]
    assert result["buffer"] == accepted.removesuffix("\n")


# -- against a scripted server: the token-id path, malformed streams, silence ---------------------


class Scripted(BaseHTTPRequestHandler):
    """Answers /v1/models and /v1/completions as ``self.server.script`` says; records bodies."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, json.dumps({"data": [{"id": "served-model"}]}).encode(), "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        kind = self.server.script
        if kind == "mute":  # not even a status line
            time.sleep(2)
            return
        if kind == "silent":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            time.sleep(2)
            return
        events = {"ok": [{"choices": [{"text": "1 + 2", "finish_reason": None}]},
                         {"choices": [{"text": "\n", "finish_reason": "stop"}]}],
                  "malformed": [{"choices": [{"text": "1"}]}, "not json"],
                  "shapeless": [{"id": "x"}]}[kind]
        stream = b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events)
        self._send(200, stream + (b"data: [DONE]\n\n" if kind == "ok" else b""), "text/event-stream")

    def _send(self, status, payload, kind):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def scripted():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    httpd.bodies, httpd.script = [], "ok"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _cfg(values: dict):
    from specd.config import load_config

    env = {"SPECD_" + k.replace(".", "_").upper(): str(v) for k, v in values.items()}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_config()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_token_ids_greedy_settings_and_the_served_model_name_are_sent(scripted):
    url = f"http://127.0.0.1:{scripted.server_address[1]}/v1"
    engine = load_engine(_cfg(remote_config(url, **{"model.remote_body": '{"top_k": 1, "seed": null}'})))
    result = engine.complete(CompletionRequest(text="def add(a, b):\n    return ", offset=26, max_tokens=8))
    assert result.text == "1 + 2\n" and result.stop_reason == "eos"
    body = scripted.bodies[-1]
    assert body["prompt"] == result.prompt_ids and all(isinstance(i, int) for i in body["prompt"])
    assert body["model"] == "served-model" and body["stream"] is True and body["max_tokens"] == 8
    assert body["temperature"] == 0.0 and body["repeat_penalty"] == 1.0 and body["top_k"] == 1
    assert "<|endoftext|>" in body["stop"] and engine.tokenizer.eos_token_id in body["stop_token_ids"]
    assert engine.stats()["remote"]["prompt"] == "tokens"
    assert completions_url("http://h:1") == completions_url("http://h:1/v1/") == "http://h:1/v1/completions"


@pytest.mark.parametrize("script, message", [
    ("malformed", "remote backend: malformed stream from the server (not JSON: 'not json')"),
    ("shapeless", "remote backend: malformed stream from the server (a chunk without choices[0].text)"),
    ("silent", "remote backend: {where} sent nothing for 0.5 s (model.remote_read_timeout_ms)"),
    ("mute", "remote backend: {where} sent nothing for 0.5 s (model.remote_read_timeout_ms)"),
])
def test_malformed_or_silent_streams_are_one_line(scripted, script, message):
    where = f"http://127.0.0.1:{scripted.server_address[1]}"
    engine = load_engine(_cfg(remote_config(where, **{"model.remote_read_timeout_ms": 500})))
    scripted.script = script
    with pytest.raises(EngineError) as failed:
        engine.complete(CompletionRequest(text="x = ", offset=4))
    assert one_line(str(failed.value)) == message.format(where=where)
    scripted.script = "ok"
    assert engine.complete(CompletionRequest(text="x = ", offset=4)).text == "1 + 2\n"


def test_context_chunks_from_other_buffers_reach_the_remote_prompt(scripted):
    """Chosen in idle time by the local engine's ContextSelector, laid out by its PromptBuilder."""
    engine = load_engine(_cfg(remote_config(f"http://127.0.0.1:{scripted.server_address[1]}")))
    helper = "def normalise_sku(code):\n    return code.strip().upper()\n"
    engine.open_document("file:///w/skus.py", helper)
    engine.open_document("file:///w/main.py", "from skus import normalise_sku\n\nsku = normalise_sku(")
    request = CompletionRequest(uri="file:///w/main.py", offset=None, max_tokens=4, path="/w/main.py")
    engine.complete(request)  # the first request names the document and its cursor region
    while engine.warm_context(0.05):
        pass
    engine.complete(request)
    prompt = scripted.bodies[-1]["prompt"]
    file_sep = engine.tokenizer.convert_tokens_to_ids("<|file_sep|>")
    assert file_sep in prompt and "normalise_sku(code)" in engine.tokenizer.decode(prompt)
    assert engine.stats()["context"]["switches"] == 1


def test_configuration_errors_are_one_line():
    with pytest.raises(EngineError, match="model.remote_url is empty"):
        RemoteOptions.from_config({"model.remote_url": ""})  # load_config refuses this before the engine sees it
    with pytest.raises(EngineError, match="is not an http:// or https:// URL"):
        remote.RemoteClient(RemoteOptions(url="ftp://x"))


def _tokenizer():
    from specd.engine.models import load_tokenizer

    return load_tokenizer(str(demo_pair_paths()[0]))

