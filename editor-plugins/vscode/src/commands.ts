// The extension's commands: toggle, restart, show status, show log.

import * as vscode from 'vscode';
import { LanguageClient } from 'vscode-languageclient/node';
import { toggleEnabled } from './config';
import { SpecdStatus, STATUS_METHOD } from './protocol';
import { statusReport } from './status';

export interface CommandContext {
  log: vscode.LogOutputChannel;
  client: () => LanguageClient | undefined;
  restart: () => Promise<void>;
}

export function registerCommands({ log, client, restart }: CommandContext): vscode.Disposable[] {
  return [
    vscode.commands.registerCommand('specd.toggle', async () => {
      const enabled = await toggleEnabled();
      vscode.window.setStatusBarMessage(`specd: completions ${enabled ? 'on' : 'off'}`, 3000);
    }),
    vscode.commands.registerCommand('specd.restart', async () => {
      log.info('restarting specd-lsp');
      await restart();
    }),
    vscode.commands.registerCommand('specd.showStatus', async () => {
      const running = client();
      if (!running?.isRunning()) {
        const choice = await vscode.window.showWarningMessage('specd: the language server is not running.', 'Restart', 'Show Log');
        if (choice === 'Restart') await restart();
        if (choice === 'Show Log') log.show();
        return;
      }
      const status = await running.sendRequest<SpecdStatus>(STATUS_METHOD, {});
      const report = statusReport(status);
      log.info(`status:\n${report}`);
      const choice = await vscode.window.showInformationMessage('specd status', { modal: true, detail: report }, 'Show Log');
      if (choice === 'Show Log') log.show();
    }),
    vscode.commands.registerCommand('specd.showLog', () => log.show()),
  ];
}
