// The language client: specd-lsp on stdio, for the configured languages.

import * as vscode from 'vscode';
import { LanguageClient, LanguageClientOptions, ServerOptions } from 'vscode-languageclient/node';
import { currentSettings, enabledFor } from './config';
import { documentSelector, serverLaunch, serverSettings, SpecdSettings } from './settings';

export const CLIENT_ID = 'specd'; // vscode-languageclient reads `specd.trace.server` by this id

export function createClient(settings: SpecdSettings, log: vscode.LogOutputChannel): LanguageClient {
  const launch = serverLaunch(settings, process.env);
  // No `transport` key: that would append `--stdio`; the server talks stdio either way.
  const serverOptions: ServerOptions = { command: launch.command, args: launch.args, options: { env: launch.env } };
  const clientOptions: LanguageClientOptions = {
    documentSelector: documentSelector(settings.languages),
    // A function, so a restart sends the settings of that moment.
    initializationOptions: () => serverSettings(currentSettings()),
    outputChannel: log,
    middleware: {
      // Per-language opt-out happens here, before any request reaches the server.
      provideInlineCompletionItems: (document, position, context, token, next) =>
        enabledFor(document) ? next(document, position, context, token) : undefined,
    },
  };
  return new LanguageClient(CLIENT_ID, 'specd', serverOptions, clientOptions);
}
