// The status bar item, fed by specd-lsp's `specd/status` notifications and the client's state.

import * as vscode from 'vscode';
import { LanguageClient, State } from 'vscode-languageclient/node';
import { SpecdStatus, STATUS_METHOD } from './protocol';
import { ClientState, statusView } from './status';

const BACKGROUNDS: Partial<Record<string, vscode.ThemeColor>> = {
  error: new vscode.ThemeColor('statusBarItem.errorBackground'),
  warning: new vscode.ThemeColor('statusBarItem.warningBackground'),
};

export class StatusBar implements vscode.Disposable {
  private readonly item = vscode.window.createStatusBarItem('specd.status', vscode.StatusBarAlignment.Right, 100);
  private status: SpecdStatus | undefined;
  private clientState: ClientState = 'starting';
  private enabled = true;
  private subscriptions: vscode.Disposable[] = [];

  constructor() {
    this.item.name = 'specd';
    this.item.command = 'specd.showStatus';
    this.render();
    this.item.show();
  }

  /** Follows a (new) client: its state changes and its status notifications. */
  attach(client: LanguageClient): void {
    this.detach();
    this.status = undefined;
    this.clientState = 'starting';
    this.subscriptions = [
      client.onNotification(STATUS_METHOD, (status: SpecdStatus) => this.update(status)),
      client.onDidChangeState(({ newState }) => {
        this.clientState = newState === State.Running ? 'running' : newState === State.Starting ? 'starting' : 'stopped';
        this.render();
        if (newState === State.Running) {
          client.sendRequest<SpecdStatus>(STATUS_METHOD, {}).then((status) => this.update(status), () => undefined);
        }
      }),
    ];
    this.render();
  }

  update(status: SpecdStatus): void {
    this.status = status;
    this.render();
  }

  setEnabled(enabled: boolean): void {
    this.enabled = enabled;
    this.render();
  }

  private render(): void {
    const view = statusView(this.status, this.clientState, this.enabled);
    this.item.text = view.text;
    this.item.tooltip = view.tooltip;
    this.item.backgroundColor = BACKGROUNDS[view.level];
  }

  private detach(): void {
    this.subscriptions.forEach((subscription) => subscription.dispose());
    this.subscriptions = [];
  }

  dispose(): void {
    this.detach();
    this.item.dispose();
  }
}
