import assert from 'node:assert/strict';
import { afterEach, beforeEach, describe, mock, test } from 'node:test';
import { Focus, FOCUS_DEBOUNCE_MS, FocusHints } from '../src/focusHints';
import { FOCUS_METHOD } from '../src/protocol';

const A = 'file:///a.py';
const B = 'file:///b.py';
const at = (uri: string, line: number, character = 0): Focus => ({ uri, line, character });

describe('cursor hints (specd/didFocus)', () => {
  let sent: Focus[];
  let running: boolean;
  let hints: FocusHints;

  beforeEach(() => {
    mock.timers.enable({ apis: ['setTimeout'] });
    sent = [];
    running = true;
    hints = new FocusHints((focus) => running && sent.push(focus) > 0);
  });

  afterEach(() => {
    hints.dispose();
    mock.timers.reset();
  });

  test('the method is the one specd-lsp takes', () => {
    assert.equal(FOCUS_METHOD, 'specd/didFocus');
  });

  test('a run of moves sends one hint, where the cursor stopped, once it has been still', () => {
    hints.moved(at(A, 3), 1, true);
    mock.timers.tick(FOCUS_DEBOUNCE_MS - 1);
    hints.moved(at(A, 7, 2), 1);
    mock.timers.tick(FOCUS_DEBOUNCE_MS - 1);
    assert.deepEqual(sent, []);
    mock.timers.tick(1);
    assert.deepEqual(sent, [at(A, 7, 2)]);
  });

  test('once per document and line; a line hinted in one document is news in another', () => {
    hints.moved(at(A, 3), 1, true);
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    hints.moved(at(A, 3, 9), 1); // along the line
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    hints.moved(at(B, 3), 1, true);
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    hints.moved(at(A, 3, 4), 1, true); // back to A, the same line as A's last hint
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    hints.moved(at(A, 4), 1);
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    assert.deepEqual(sent, [at(A, 3), at(B, 3), at(A, 4)]);
  });

  test('a cursor moved by an edit is typing: no hint, and the pending one is dropped', () => {
    hints.moved(at(A, 3), 1, true);
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    hints.moved(at(A, 5), 1); // a jump...
    hints.moved(at(A, 6), 2); // ...then Enter typed before it came to rest
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    assert.deepEqual(sent, [at(A, 3)]);
    hints.moved(at(A, 9), 2); // a jump with no edit since
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    hints.moved(at(B, 1), 5, true); // entering an editor is always a place to hint
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    assert.deepEqual(sent, [at(A, 3), at(A, 9), at(B, 1)]);
  });

  test('a hint the client could not send, or for a document closed since, goes again', () => {
    running = false;
    hints.moved(at(A, 3), 1, true);
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    running = true;
    hints.moved(at(A, 3), 1, true);
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    assert.deepEqual(sent, [at(A, 3)]);
    hints.forget(A);
    hints.moved(at(A, 3), 1, true);
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    hints.moved(at(B, 2), 1, true);
    hints.forget(B); // closed while its hint was pending
    mock.timers.tick(FOCUS_DEBOUNCE_MS);
    assert.deepEqual(sent, [at(A, 3), at(A, 3)]);
  });
});
