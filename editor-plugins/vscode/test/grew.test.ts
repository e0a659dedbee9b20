import assert from 'node:assert/strict';
import { test } from 'node:test';
import { isAt, SuggestionGrew } from '../src/protocol';

const note: SuggestionGrew = { uri: 'file:///a.py', version: 3, position: { line: 4, character: 8 } };

test('a grown suggestion re-triggers only where the user still is', () => {
  const here = { uri: 'file:///a.py', version: 3, line: 4, character: 8 };
  assert.equal(isAt(note, here), true);
  assert.equal(isAt(note, undefined), false);
  assert.equal(isAt(note, { ...here, version: 4 }), false); // typed since: a new request serves it
  assert.equal(isAt(note, { ...here, character: 9 }), false);
  assert.equal(isAt(note, { ...here, uri: 'file:///b.py' }), false);
});
