// Entry point: start specd-lsp through the language client; follow settings; stop on deactivate.

import * as vscode from 'vscode';
import { DidChangeConfigurationNotification, LanguageClient } from 'vscode-languageclient/node';
import { createClient } from './client';
import { followFocus } from './focus';
import { followGrowth } from './grew';
import { registerCommands } from './commands';
import { currentSettings, SECTION } from './config';
import { needsRestart, serverSettings, startFailureMessage } from './settings';
import { StatusBar } from './statusBar';

const STOP_TIMEOUT_MS = 2000;
let client: LanguageClient | undefined;
let growth: vscode.Disposable | undefined; // re-triggers the inline suggestion when it grew
let focus: vscode.Disposable | undefined; // tells specd-lsp where the cursor came to rest

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  const log = vscode.window.createOutputChannel('specd', { log: true });
  const statusBar = new StatusBar();

  const start = async (): Promise<void> => {
    const settings = currentSettings();
    await setEnabledContext(settings.enable, statusBar);
    client = createClient(settings, log);
    statusBar.attach(client);
    growth?.dispose();
    growth = followGrowth(client);
    focus?.dispose();
    focus = undefined;
    try {
      await client.start();
      focus = followFocus(client);
    } catch (err) {
      const inspected = vscode.workspace.getConfiguration(SECTION).inspect<string>('serverPath');
      const message = startFailureMessage(settings.serverPath, {
        folder: inspected?.workspaceFolderValue, workspace: inspected?.workspaceValue, user: inspected?.globalValue,
      }, vscode.env.remoteName);
      log.error(`${message} (${err})`);
      void vscode.window.showErrorMessage(message, 'Open Settings', 'Show Log').then((choice) => {
        if (choice === 'Show Log') log.show();
        if (choice === 'Open Settings') void vscode.commands.executeCommand('workbench.action.openSettings', 'specd.serverPath');
      });
    }
  };
  const restart = async (): Promise<void> => {
    await client?.dispose(STOP_TIMEOUT_MS).catch(() => undefined);
    await start();
  };

  context.subscriptions.push(
    log,
    statusBar,
    ...registerCommands({ log, client: () => client, restart }),
    vscode.workspace.onDidChangeConfiguration(async (event) => {
      if (!event.affectsConfiguration(SECTION)) return;
      if (needsRestart((section) => event.affectsConfiguration(section))) return restart();
      const settings = currentSettings();
      await setEnabledContext(settings.enable, statusBar);
      if (client?.isRunning()) {
        await client.sendNotification(DidChangeConfigurationNotification.type, { settings: serverSettings(settings) });
      }
    }),
  );
  await start();
}

export async function deactivate(): Promise<void> {
  focus?.dispose();
  focus = undefined;
  await client?.dispose(STOP_TIMEOUT_MS);
  client = undefined;
}

/** `specd.enabled` gates the keybindings, so they never act while specd is off. */
async function setEnabledContext(enabled: boolean, statusBar: StatusBar): Promise<void> {
  statusBar.setEnabled(enabled);
  await vscode.commands.executeCommand('setContext', 'specd.enabled', enabled);
}
