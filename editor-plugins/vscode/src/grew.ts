// A suggestion that grew: specd-lsp answers with a suggestion's first line as soon as it is
// written and tells the client when more of it arrived (specd/suggestionGrew). If that is the
// editor the user is in, at the same document version and cursor, asking again shows the longer
// item: specd-lsp serves it from its cache, with no model work.

import * as vscode from 'vscode';
import { LanguageClient } from 'vscode-languageclient/node';
import { EditorAt, GREW_METHOD, isAt, SuggestionGrew } from './protocol';

function activeEditorAt(client: LanguageClient): EditorAt | undefined {
  const editor = vscode.window.activeTextEditor;
  if (editor === undefined || !editor.selection.isEmpty) return undefined;
  const position = client.code2ProtocolConverter.asPosition(editor.selection.active);
  return {
    uri: client.code2ProtocolConverter.asUri(editor.document.uri),
    version: editor.document.version,
    line: position.line,
    character: position.character,
  };
}

// Asked again at the same place, VS Code keeps the item it shows: an automatic request there is
// answered with the items it holds, and an explicit one puts the shown item back in front of the
// new ones. So the shorter item is hidden first, then an automatic request (`explicit: false`)
// goes to specd-lsp, which answers from its cache. (An explicit request would also be an invoked
// one, answered with alternatives from the model.)
async function showGrown(): Promise<void> {
  await vscode.commands.executeCommand('editor.action.inlineSuggest.hide');
  await vscode.commands.executeCommand('editor.action.inlineSuggest.trigger', { explicit: false });
}

/** Re-trigger the inline suggestion when the one shown grew. */
export function followGrowth(client: LanguageClient): vscode.Disposable {
  return client.onNotification(GREW_METHOD, (note: SuggestionGrew) => {
    if (isAt(note, activeEditorAt(client))) {
      void showGrown();
    }
  });
}
