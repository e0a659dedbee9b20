// The cancel-then-ask race as VS Code's client runs it, against the real specd-lsp.
//
// Each round spawns a fresh specd-lsp and talks to it with vscode-languageserver-protocol's
// createProtocolConnection (the library under vscode-languageclient 11, which the extension
// ships): initialize as VS Code 1.99 does (UTF-16 positions, inline completion) with the
// extension's default initializationOptions, open FILE with a blank line of 8 spaces inserted
// before LINE, send textDocument/inlineCompletion at the end of that blank line with a
// CancellationTokenSource cancelled right after the send, send the same request again and await
// it. A round whose second answer has no items is an empty answer. Nothing waits for specd-lsp's
// link to the daemon: VS Code asks as soon as the user types, however fresh the server.
//
// The daemon is whatever specd-lsp finds from its environment (XDG_RUNTIME_DIR, SPECD_*), the
// same for every round. Prints one JSON line per round and a summary line
// {"rounds", "empty", "emptyRounds", ...}; exits 0 when it ran (empty answers are counted, not
// failed: the caller judges), 2 on a usage or protocol failure.
//
//   node tests/node/cancel_race.mjs --server .venv/bin/specd-lsp --file tests/data/sample_module.py \
//       --line 27 --rounds 100 [--trigger automatic|invoked] [--control]
//
// --control first runs one round without the cancel, waiting for specd-lsp's link to be ready,
// and fails (exit 3) when even that answer is empty: a position where the model suggests nothing
// would count every round as empty.

import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import {
  CancellationTokenSource, ConfigurationRequest, createProtocolConnection, DidOpenTextDocumentNotification,
  ExitNotification, InitializedNotification, InitializeRequest, InlineCompletionRequest,
  InlineCompletionTriggerKind, ShutdownRequest, StreamMessageReader, StreamMessageWriter,
} from 'vscode-languageserver-protocol/node';

const REPO = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
const EXTENSION_MANIFEST = join(REPO, 'editor-plugins', 'vscode', 'package.json');
const STATUS_METHOD = 'specd/status';
const INDENT = ' '.repeat(8);
const REQUEST_TIMEOUT_MS = 30_000;
const EXIT_TIMEOUT_MS = 10_000;
const READY_TIMEOUT_MS = 60_000;

const { values: args } = parseArgs({
  options: {
    server: { type: 'string', default: 'specd-lsp' },
    file: { type: 'string' },
    line: { type: 'string' },
    rounds: { type: 'string', default: '100' },
    trigger: { type: 'string', default: 'automatic' },
    control: { type: 'boolean', default: false },
  },
});
if (!args.file || args.line === undefined || !['automatic', 'invoked'].includes(args.trigger)) {
  console.error('usage: cancel_race.mjs --file FILE --line LINE [--server specd-lsp] [--rounds N] '
    + '[--trigger automatic|invoked] [--control]');
  process.exit(2);
}

/** The extension's initializationOptions with every setting at its default: serverSettings() of
 *  editor-plugins/vscode/src/settings.ts over the defaults package.json declares. */
function extensionDefaults() {
  const properties = JSON.parse(readFileSync(EXTENSION_MANIFEST, 'utf8')).contributes.configuration.properties;
  const get = (name) => {
    const setting = properties[`specd.${name}`];
    if (!setting) throw new Error(`package.json declares no specd.${name}`);
    return setting.default;
  };
  return {
    enable: get('enable'),
    triggerMode: get('triggerMode'),
    maxTokens: get('maxTokens'),
    singleLine: get('singleLine'),
    debounceMs: get('debounceMs'),
    alternatives: get('alternatives'),
    temperature: get('temperature'),
    daemon: { socket: get('daemon.socket'), spawn: get('daemon.spawn'), spawnTimeoutS: get('daemon.spawnTimeoutS') },
    cache: { typeThrough: get('cache.typeThrough'), prefetch: get('cache.prefetch') },
    log: { level: get('log.level'), file: get('log.file') },
  };
}

/** What VS Code 1.99's language client (vscode-languageclient 11) declares, in the parts that
 *  reach specd-lsp's choices: UTF-16 positions, inline completion, pulled configuration. */
const CAPABILITIES = {
  general: { positionEncodings: ['utf-16'], markdown: { parser: 'marked', version: '1.1.0' } },
  workspace: {
    applyEdit: true, configuration: true, workspaceFolders: true,
    didChangeConfiguration: { dynamicRegistration: true },
    executeCommand: { dynamicRegistration: true },
  },
  textDocument: {
    synchronization: { dynamicRegistration: true, willSave: true, willSaveWaitUntil: true, didSave: true },
    inlineCompletion: { dynamicRegistration: true },
    completion: { dynamicRegistration: true, contextSupport: true, completionItem: { snippetSupport: true } },
  },
  window: { showMessage: { messageActionItem: { additionalPropertiesSupport: true } }, workDoneProgress: true },
};

const text = (() => {
  const lines = readFileSync(args.file, 'utf8').split('\n');
  lines.splice(Number(args.line), 0, INDENT);
  return lines.join('\n');
})();
const uri = pathToFileURL(resolve(args.file)).href;
const position = { line: Number(args.line), character: INDENT.length };
const triggerKind = args.trigger === 'invoked' ? InlineCompletionTriggerKind.Invoked : InlineCompletionTriggerKind.Automatic;
const initializationOptions = extensionDefaults();

const itemsOf = (result) => (result == null ? [] : Array.isArray(result) ? result : result.items);

function within(promise, ms, what, log) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no answer in ${ms} ms\n${log()}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** One round on a fresh specd-lsp: the second answer's item count and first text, whether the
 *  first request was cancelled, the link states seen, timings, and specd-lsp's last daemon answer. */
async function round(cancel) {
  const started = Date.now();
  const server = spawn(args.server, [], { stdio: ['pipe', 'pipe', 'pipe'], env: process.env });
  let stderr = '';
  server.stderr.on('data', (chunk) => { stderr += chunk; });
  const exited = new Promise((resolveExit) => server.on('exit', resolveExit));
  const spawnFailed = new Promise((_, reject) => server.on('error', reject));
  const log = () => stderr.slice(-4000);
  const connection = createProtocolConnection(new StreamMessageReader(server.stdout), new StreamMessageWriter(server.stdin));
  const states = [];
  let readyAt = null;
  let ready;
  const readyNow = new Promise((resolveReady) => { ready = resolveReady; });
  connection.onNotification(STATUS_METHOD, (status) => {
    states.push(status.state);
    if (status.state === 'ready' && readyAt === null) {
      readyAt = Date.now();
      ready();
    }
  });
  connection.onNotification('window/showMessage', () => undefined);
  connection.onRequest(ConfigurationRequest.type, (params) => params.items.map(() => initializationOptions));
  connection.listen();
  try {
    await Promise.race([spawnFailed, within(connection.sendRequest(InitializeRequest.type, {
      processId: process.pid,
      clientInfo: { name: 'Visual Studio Code', version: '1.99.0' },
      locale: 'en',
      rootUri: null,
      workspaceFolders: null,
      capabilities: CAPABILITIES,
      initializationOptions,
    }), REQUEST_TIMEOUT_MS, 'initialize', log)]);
    await connection.sendNotification(InitializedNotification.type, {});
    await connection.sendNotification(DidOpenTextDocumentNotification.type, {
      textDocument: { uri, languageId: 'python', version: 1, text },
    });
    const params = { textDocument: { uri }, position, context: { triggerKind } };
    let firstCancelled = null;
    if (cancel) {
      const source = new CancellationTokenSource();
      const first = connection.sendRequest(InlineCompletionRequest.type, params, source.token);
      source.cancel();
      first.then(() => { firstCancelled = false; }, () => { firstCancelled = true; });
    } else {
      await within(readyNow, READY_TIMEOUT_MS, 'specd-lsp ready', log);
    }
    const asked = Date.now();
    const second = await within(connection.sendRequest(InlineCompletionRequest.type, params), REQUEST_TIMEOUT_MS,
      'textDocument/inlineCompletion', log);
    const answerMs = Date.now() - asked;
    const items = itemsOf(second);
    // What specd-lsp says of its last daemon answer: an empty round's why (time budget, error).
    const status = await within(connection.sendRequest(STATUS_METHOD, {}), REQUEST_TIMEOUT_MS, STATUS_METHOD, log);
    const daemon = { stopReason: status.lastStopReason, latencyMs: status.lastLatencyMs, error: status.lastError,
      requests: status.daemonRequests, cancelled: status.cancelled, failed: status.failed };
    await within(connection.sendRequest(ShutdownRequest.type), REQUEST_TIMEOUT_MS, 'shutdown', log);
    await connection.sendNotification(ExitNotification.type);
    await within(exited, EXIT_TIMEOUT_MS, 'specd-lsp to exit', log);
    // readyMs: when specd-lsp said its link to the daemon was ready, from the second request's send.
    return { items: items.length, text: items[0]?.insertText ?? null, firstCancelled, states,
      readyMs: readyAt === null ? null : readyAt - asked, answerMs, daemon, ms: Date.now() - started,
      stderr: items.length ? undefined : log() };
  } finally {
    connection.dispose();
    if (server.exitCode === null && server.signalCode === null) server.kill();
  }
}

async function main() {
  if (args.control) {
    const control = await round(false);
    console.log(JSON.stringify({ control: true, ...control }));
    if (!control.items) {
      console.error('the unraced request at this position got no items: choose another line');
      process.exit(3);
    }
  }
  const rounds = Number(args.rounds);
  const emptyRounds = [];
  const ms = [];
  for (let n = 0; n < rounds; n += 1) {
    const result = await round(true);
    ms.push(result.ms);
    if (!result.items) emptyRounds.push(n);
    console.log(JSON.stringify({ round: n, ...result }));
  }
  ms.sort((a, b) => a - b);
  console.log(JSON.stringify({ rounds, empty: emptyRounds.length, emptyRounds, trigger: args.trigger,
    roundMsP50: ms[Math.floor(ms.length / 2)] ?? null }));
}

main().catch((err) => {
  console.error(err?.stack ?? String(err));
  process.exit(2);
});
