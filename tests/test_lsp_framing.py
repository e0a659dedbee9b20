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
