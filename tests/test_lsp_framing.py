"""specd-lsp on a broken stdio stream: a framing error ends the process (status 1, one log line)
so the editor restarts it, instead of leaving it alive but deaf. A body of the right
length that is not JSON is answered with a parse error and the server reads on.

Each test runs the real ``python -m specd_lsp.server`` with raw bytes on its stdin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lsp_helpers import server_env

READ_TIMEOUT_S = 1.0  # the server's --read-timeout here (default 10 s)
EXIT_WITHIN_S = 20.0  # generous: a loaded 2-core machine, and the server's own start


def frame(payload: dict | bytes, length: int | None = None, header: bytes | None = None) -> bytes:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    if header is None:
        header = b"Content-Length: %d\r\n" % (len(body) if length is None else length)
    return header + b"\r\n" + body


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"processId": None, "rootUri": None, "capabilities": {}}}
SHUTDOWN = {"jsonrpc": "2.0", "id": 2, "method": "shutdown"}


class RawServer:
    def __init__(self, root: Path):
        self.stderr_path = root / "lsp.stderr"
        self.stderr_file = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specd_lsp.server", "--read-timeout", str(READ_TIMEOUT_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr_file, env=server_env(root))

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def read_message(self) -> dict:
        """The next message on stdout (blocking; the tests bound the whole run with wait())."""
        length = None
        while True:
            line = self.proc.stdout.readline()
            assert line, f"stdout ended; stderr:\n{self.stderr()}"
            if line == b"\r\n":
                break
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        return json.loads(self.proc.stdout.read(length))

    def response(self, msg_id) -> dict:
        while True:
            message = self.read_message()
            if message.get("id") == msg_id and "method" not in message:
                return message

    def wait_exit(self) -> tuple[int, float]:
        started = time.monotonic()
        code = self.proc.wait(EXIT_WITHIN_S)
        return code, time.monotonic() - started

    def stderr(self) -> str:
        self.stderr_file.flush()
        return self.stderr_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.stderr_file.close()


@pytest.fixture
def server(tmp_path):
    raw = RawServer(tmp_path)
    raw.send(frame(INITIALIZE))
    assert "capabilities" in raw.response(1)["result"]  # alive and answering before the fault
    yield raw
    raw.close()


def _assert_exited_on_framing(server: RawServer, within: float, names: str) -> None:
    code, waited = server.wait_exit()
    lines = [line for line in server.stderr().splitlines() if line.strip()]
    print(f"\nexit {code} after {waited:.2f} s: {lines[-1]}")
    assert code == 1
    assert waited < within
    assert "Traceback" not in server.stderr()
    framing = [line for line in lines if "framing error" in line]
    assert len(framing) == 1 and framing == lines[-1:], lines
    assert names in framing[0]


@pytest.mark.parametrize("header, names", [
    (b"Content-Length: abc\r\n", "bad Content-Length"),
    (b"Content-Length: -5\r\n", "bad Content-Length"),
    (b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n", "without a Content-Length"),
    (b"Content-Length: 99999999999\r\n", "at most"),
    (b"this is not a header\r\n", "malformed header line"),
])
def test_a_bad_header_exits_at_once(server, header, names):
    server.send(frame(SHUTDOWN, header=header))
    _assert_exited_on_framing(server, EXIT_WITHIN_S, names)


@pytest.mark.parametrize("then", [b"", frame(SHUTDOWN)])
def test_a_content_length_too_short_exits(server, then):
    """The body is cut: it is not JSON (a parse error), and what follows is no header: the rest
    of the body, alone (a stall in a header line) or run into the next message."""
    body = json.dumps(SHUTDOWN).encode()
    server.send(frame(body, length=len(body) - 10) + then)
    _assert_exited_on_framing(server, EXIT_WITHIN_S, "malformed header line" if then else "left unfinished")


def test_a_content_length_too_long_exits_once_the_bytes_stop(server):
    """The server waits for bytes that never come; editors write a message at once, so a stall
    of --read-timeout seconds inside a message is a framing error."""
    body = json.dumps(SHUTDOWN).encode()
    server.send(frame(body, length=len(body) + 100))
    _assert_exited_on_framing(server, READ_TIMEOUT_S + EXIT_WITHIN_S, "then nothing")


def test_the_input_ending_inside_a_message_exits(server):
    server.send(b"Content-Length: 50\r\n\r\n{\"jsonrpc\"")
    server.proc.stdin.close()
    _assert_exited_on_framing(server, EXIT_WITHIN_S, "ended 10 bytes into a 50-byte message")


def test_a_body_that_is_not_json_gets_a_parse_error_and_the_server_reads_on(server):
    server.send(frame(b"{this is not json}"))
    error = server.read_message()
    assert error["id"] is None and error["error"]["code"] == -32700
    server.send(frame(SHUTDOWN))
    assert server.response(2)["result"] is None
    server.send(frame({"jsonrpc": "2.0", "method": "exit"}))
    code, _ = server.wait_exit()
    assert code == 0
    assert "framing error" not in server.stderr() and "Traceback" not in server.stderr()


def test_headers_in_any_case_and_bare_newlines_are_read(server):
    body = json.dumps(SHUTDOWN).encode()
    server.send(b"content-length: %d\nContent-Type: application/vscode-jsonrpc; charset=utf-8\n\n" % len(body) + body)
    assert server.response(2)["result"] is None
    assert server.proc.poll() is None
    os.kill(server.proc.pid, 0)


# Bodies that are JSON but not LSP messages, and what each must get: the JSON-RPC error code and
# id of its answer, or None when nothing is answered (a notification's fault is only logged).
DEEP = b"[" * 100_000 + b"]" * 100_000
MALFORMED = {
    "a batch of two requests": ([{"jsonrpc": "2.0", "id": 50, "method": "shutdown"},
                                 {"jsonrpc": "2.0", "id": 51, "method": "shutdown"}], (-32600, None)),
    "an empty array": ([], (-32600, None)),
    "a string": ("hello", (-32600, None)),
    "a number": (42, (-32600, None)),
    "null": (None, (-32600, None)),
    "a numeric method": ({"jsonrpc": "2.0", "id": 7, "method": 123}, (-32600, 7)),
    "a null method": ({"jsonrpc": "2.0", "id": 8, "method": None}, (-32600, 8)),
    "an empty method": ({"jsonrpc": "2.0", "id": 9, "method": ""}, (-32600, 9)),
    "an object id": ({"jsonrpc": "2.0", "id": {"a": 1}, "method": "shutdown"}, (-32600, None)),
    "a boolean id": ({"jsonrpc": "2.0", "id": True, "method": "shutdown"}, (-32600, None)),
    "a fractional id": ({"jsonrpc": "2.0", "id": 1.5, "method": "shutdown"}, (-32600, None)),
    "no jsonrpc": ({"id": 10, "method": "shutdown"}, (-32600, 10)),
    "jsonrpc 1.0": ({"jsonrpc": "1.0", "id": 11, "method": "shutdown"}, (-32600, 11)),
    "string params": ({"jsonrpc": "2.0", "id": 12, "method": "textDocument/hover", "params": "x"}, (-32602, 12)),
    "wrongly typed params": ({"jsonrpc": "2.0", "id": 13, "method": "textDocument/inlineCompletion",
                              "params": {"textDocument": 5}}, (-32602, 13)),
    "a notification with numeric params": ({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": 5}, None),
    "a notification with wrongly typed params": ({"jsonrpc": "2.0", "method": "textDocument/didOpen",
                                                  "params": {"textDocument": 5}}, None),
    "a notification with a numeric method": ({"jsonrpc": "2.0", "method": 5}, None),
    "a response without result or error": ({"jsonrpc": "2.0", "id": 99}, (-32600, None)),
    "a response to no request": ({"jsonrpc": "2.0", "id": 12345, "result": None}, None),
    "an unknown method": ({"jsonrpc": "2.0", "id": 14, "method": "specd/nothing"}, (-32601, 14)),
    "JSON nested 100,000 deep": (DEEP, (-32700, None)),
}


def test_every_malformed_message_gets_its_one_line_error_and_no_traceback(server):
    """Each body of the table, then a marker request: what came back before the marker's answer
    is exactly the case's error (or nothing), and stderr never shows a traceback."""
    got = {}
    for number, (name, (body, _)) in enumerate(MALFORMED.items()):
        server.send(frame(body if isinstance(body, bytes) else json.dumps(body).encode()))
        marker = f"marker-{number}"
        server.send(frame({"jsonrpc": "2.0", "id": marker, "method": "specd/status"}))
        answers = []
        while True:
            message = server.read_message()
            if message.get("id") == marker and "method" not in message:
                break
            if "method" not in message:
                answers.append((message["error"]["code"], message["id"]) if "error" in message else message)
        got[name] = answers[0] if len(answers) == 1 else (answers or None)
    expected = {name: answer for name, (_, answer) in MALFORMED.items()}
    assert got == expected
    server.send(frame(SHUTDOWN))
    assert server.response(2)["result"] is None  # serving on
    log = server.stderr()
    assert "Traceback" not in log, log[log.find("Traceback") - 200:][:3000]
    assert log.count("not LSP") >= len([a for a in expected.values() if a and a[0] in (-32600, -32602)])
