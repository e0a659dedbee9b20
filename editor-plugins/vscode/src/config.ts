// The settings as VS Code holds them (`specd.*`); the mapping itself lives in settings.ts.

import * as vscode from 'vscode';
import { readSettings, SpecdSettings } from './settings';

export const SECTION = 'specd';

export function currentSettings(): SpecdSettings {
  return readSettings(vscode.workspace.getConfiguration(SECTION));
}

/** `specd.enable` for this document, so a `"[markdown]": {"specd.enable": false}` override holds. */
export function enabledFor(document: vscode.TextDocument): boolean {
  return vscode.workspace.getConfiguration(SECTION, document).get<boolean>('enable', true);
}

/** Flips `specd.enable` in the user settings; returns the new value. */
export async function toggleEnabled(): Promise<boolean> {
  const enable = !currentSettings().enable;
  await vscode.workspace.getConfiguration(SECTION).update('enable', enable, vscode.ConfigurationTarget.Global);
  return enable;
}
