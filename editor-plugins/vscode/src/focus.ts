// Cursor hints: where the cursor came to rest goes to specd-lsp (specd/didFocus), which passes it
// to the daemon; the daemon prefills the prompt a completion there needs while the user reads, so
// the first suggestion in a file just opened does not wait for it. The rules are focusHints.ts's.

import * as vscode from 'vscode';
import { LanguageClient } from 'vscode-languageclient/node';
import { enabledFor } from './config';
import { Focus, FocusHints } from './focusHints';
import { DidFocusParams, FOCUS_METHOD } from './protocol';

/** Send a hint whenever the cursor comes to rest in a document the client serves (from a started client). */
export function followFocus(client: LanguageClient): vscode.Disposable {
  const hints = new FocusHints((focus: Focus) => {
    if (!client.isRunning()) return false;
    const params: DidFocusParams = {
      textDocument: { uri: focus.uri },
      position: { line: focus.line, character: focus.character },
    };
    client.sendNotification(FOCUS_METHOD, params).catch(() => undefined); // a hint: nothing to do if it fails
    return true;
  });
  const moved = (editor: vscode.TextEditor | undefined, entered: boolean): void => {
    if (editor === undefined || !serves(client, editor.document)) return;
    const position = client.code2ProtocolConverter.asPosition(editor.selection.active);
    const uri = client.code2ProtocolConverter.asUri(editor.document.uri);
    hints.moved({ uri, line: position.line, character: position.character }, editor.document.version, entered);
  };
  moved(vscode.window.activeTextEditor, true); // the editor open when the client started
  return vscode.Disposable.from(
    vscode.window.onDidChangeTextEditorSelection((event) => moved(event.textEditor, false)),
    vscode.window.onDidChangeActiveTextEditor((editor) => moved(editor, true)),
    vscode.workspace.onDidCloseTextDocument((document) => hints.forget(client.code2ProtocolConverter.asUri(document.uri))),
    hints,
  );
}

/** Documents the client syncs (its documentSelector) and specd is enabled for. */
function serves(client: LanguageClient, document: vscode.TextDocument): boolean {
  const selector = client.clientOptions.documentSelector;
  return selector !== undefined && enabledFor(document) &&
    vscode.languages.match(client.protocol2CodeConverter.asDocumentSelector(selector), document) > 0;
}
