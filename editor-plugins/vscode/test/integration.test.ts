// The real specd-lsp (and a real daemon on a tiny random-weight model), driven through
// vscode-languageserver-protocol, the protocol library VS Code's client is built on.

import assert from 'node:assert/strict';
import { ChildProcess, spawn } from 'node:child_process';
import { after, before, describe, test } from 'node:test';
import {
  createProtocolConnection, DidChangeConfigurationNotification, DidOpenTextDocumentNotification, ExecuteCommandRequest,
  ExitNotification, InitializedNotification, InitializeRequest, InitializeResult, InlineCompletionItem,
  InlineCompletionList, InlineCompletionRequest, InlineCompletionTriggerKind, ProtocolConnection, ShowMessageNotification,
  ShowMessageParams, ShutdownRequest, StreamMessageReader, StreamMessageWriter,
} from 'vscode-languageserver-protocol/node';
import { ACCEPTED_COMMAND, SpecdStatus, STATUS_METHOD } from '../src/protocol';
import { readSettings, serverLaunch, serverSettings } from '../src/settings';
import { statusReport, statusView } from '../src/status';
import { fakeConfig, serverPath, specdEnvironment, SpecdEnvironment, waitFor } from './helpers';

const READY_TIMEOUT_MS = 180_000; // a daemon started here imports torch and loads the models
const REQUEST_TIMEOUT_MS = 30_000;
const URI = 'file:///tmp/specd-vscode-test/fib.py';
const SOURCE = [
  'def fibonacci(n):',
  '    """Return the n-th Fibonacci number."""',
  '    if n < 2:',
  '        return n',
  '    return fibonacci(n - 1) + fibonacci(n - 2)',
  '',
  '',
  'def main():',
  '    ',
  '',
].join('\n');
const CURSOR = { line: 8, character: 4 };

// What a user would have in settings.json, through the extension's own mapping.
const USER_SETTINGS = { serverPath: serverPath(), maxTokens: 16, debounceMs: 0 };

describe('specd-lsp through vscode-languageserver-protocol', { timeout: READY_TIMEOUT_MS + 60_000 }, () => {
  let specd: SpecdEnvironment;
  let server: ChildProcess;
  let connection: ProtocolConnection;
  let stderr = '';
  const statuses: SpecdStatus[] = [];
  const messages: ShowMessageParams[] = [];

  const lastStatus = () => statuses[statuses.length - 1];
  const request = <R>(promise: Promise<R>, what: string): Promise<R> => Promise.race([
    promise,
    new Promise<R>((_, reject) => setTimeout(() => reject(new Error(`${what}: no answer in ${REQUEST_TIMEOUT_MS} ms\n${stderr}`)), REQUEST_TIMEOUT_MS).unref()),
  ]);
  const inlineCompletion = (triggerKind: InlineCompletionTriggerKind) => request(connection.sendRequest(InlineCompletionRequest.type, {
    textDocument: { uri: URI }, position: CURSOR, context: { triggerKind },
  }), 'textDocument/inlineCompletion');
  const itemsOf = (result: InlineCompletionList | InlineCompletionItem[] | null): InlineCompletionItem[] =>
    result === null ? [] : Array.isArray(result) ? result : result.items;

  before(async () => {
    specd = specdEnvironment();
    const settings = readSettings(fakeConfig(USER_SETTINGS));
    const launch = serverLaunch(settings, specd.env);
    server = spawn(launch.command, launch.args, { env: launch.env, stdio: ['pipe', 'pipe', 'pipe'] });
    server.stderr!.on('data', (chunk) => { stderr += chunk; });
    connection = createProtocolConnection(new StreamMessageReader(server.stdout!), new StreamMessageWriter(server.stdin!));
    connection.onNotification(STATUS_METHOD, (status: SpecdStatus) => { statuses.push(status); });
    connection.onNotification(ShowMessageNotification.type, (params) => { messages.push(params); });
    connection.listen();

    const init: InitializeResult = await request(connection.sendRequest(InitializeRequest.type, {
      processId: process.pid,
      rootUri: null,
      capabilities: {
        general: { positionEncodings: ['utf-16'] },
        textDocument: { synchronization: { dynamicRegistration: false }, inlineCompletion: { dynamicRegistration: false } },
        window: { showMessage: {} },
      },
      initializationOptions: serverSettings(settings),
    }), 'initialize');
    assert.ok(init.capabilities.inlineCompletionProvider, 'the server offers inline completion');
    assert.equal(init.capabilities.completionProvider, undefined, 'no completion fallback for a client with inline completion');
    await connection.sendNotification(InitializedNotification.type, {});
    await connection.sendNotification(DidOpenTextDocumentNotification.type, {
      textDocument: { uri: URI, languageId: 'python', version: 1, text: SOURCE },
    });
    await waitFor(() => {
      const state = lastStatus()?.state;
      if (state === 'unavailable') throw new Error(`specd-lsp: daemon unavailable: ${lastStatus()?.message}\n${stderr}`);
      return state === 'ready';
    }, READY_TIMEOUT_MS, () => `daemon ready (states so far: ${JSON.stringify(statuses.map((s) => s.state))})\n${stderr}`);
  });

  after(async () => {
    try {
      if (connection && server.exitCode === null) {
        await request(connection.sendRequest(ShutdownRequest.type), 'shutdown');
        await connection.sendNotification(ExitNotification.type);
        await waitFor(() => server.exitCode !== null, 10_000, 'specd-lsp to exit');
      }
    } finally {
      server?.kill();
      connection?.dispose();
      specd?.cleanup();
    }
  });

  test('the extension\'s settings pass the server\'s checks (no "ignored invalid settings" message)', () => {
    assert.deepEqual(messages.filter((m) => /invalid settings/.test(m.message)), []);
  });

  test('an invoked inline completion returns an item from the model, with the accept command', async () => {
    const items = itemsOf(await inlineCompletion(InlineCompletionTriggerKind.Invoked));
    assert.ok(items.length >= 1, `no items\n${stderr}`);
    const item = items[0];
    assert.equal(typeof item.insertText, 'string');
    assert.ok((item.insertText as string).length > 0);
    assert.equal(item.range?.start.line, CURSOR.line);
    assert.equal(item.command?.command, ACCEPTED_COMMAND);

    // The accept VS Code runs after inserting the item reaches the server's statistics.
    await request(connection.sendRequest(ExecuteCommandRequest.type, item.command!), 'workspace/executeCommand');
    await waitFor(() => (lastStatus()?.accepted ?? 0) >= 1, REQUEST_TIMEOUT_MS, 'a status notification counting the accept');
  });

  test('the status bar and status report render the server\'s status', async () => {
    const status = await request(connection.sendRequest<SpecdStatus>(STATUS_METHOD, {}), STATUS_METHOD);
    assert.equal(status.state, 'ready');
    const view = statusView(status, 'running', true);
    assert.equal(view.level, 'ok');
    assert.match(view.text, /^\$\(sparkle\) specd \d+(\.\d)? ms/);
    assert.match(statusReport(status), /^state: ready$/m);
    assert.match(statusReport(status), /^target model: .+target$/m);
  });

  test('toggling off (didChangeConfiguration from the same mapping) stops suggestions; on again brings them back', async () => {
    const send = (enable: boolean) => connection.sendNotification(DidChangeConfigurationNotification.type,
      { settings: serverSettings(readSettings(fakeConfig({ ...USER_SETTINGS, enable }))) });
    await send(false);
    await waitFor(() => lastStatus()?.enabled === false, REQUEST_TIMEOUT_MS, 'status enabled=false');
    assert.equal(statusView(lastStatus(), 'running', true).level, 'off');
    assert.deepEqual(itemsOf(await inlineCompletion(InlineCompletionTriggerKind.Invoked)), []);
    await send(true);
    await waitFor(() => lastStatus()?.enabled === true, REQUEST_TIMEOUT_MS, 'status enabled=true');
    assert.ok(itemsOf(await inlineCompletion(InlineCompletionTriggerKind.Automatic)).length >= 1);
  });
});
