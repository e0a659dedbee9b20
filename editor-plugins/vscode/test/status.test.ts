import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import type { SpecdStatus } from '../src/protocol';
import { draftAcceptance, formatMs, statusReport, statusView } from '../src/status';

const READY: SpecdStatus = {
  state: 'ready',
  enabled: true,
  positionEncoding: 'utf-16',
  daemon: { pid: 4242, version: '0.1.0', state: 'ready', models: { target: 'Qwen/Qwen2.5-Coder-1.5B', draft: 'Qwen/Qwen2.5-Coder-0.5B', device: 'cuda:0' } },
  shown: 10,
  accepted: 4,
  cacheHits: 2,
  lastLatencyMs: 41.6,
  acceptance: { lookup: { proposed: 30, accepted: 27, rate: 0.9 }, draft: { proposed: 70, accepted: 51, rate: 0.729 } },
};

describe('status bar text', () => {
  test('ready: last latency and draft acceptance over all sources', () => {
    const view = statusView(READY, 'running', true);
    assert.equal(view.text, '$(sparkle) specd 42 ms · 78%');
    assert.equal(view.level, 'ok');
    assert.match(view.tooltip, /model Qwen\/Qwen2.5-Coder-1.5B \+ draft Qwen\/Qwen2.5-Coder-0.5B/);
    assert.match(view.tooltip, /suggestions accepted 4 of 10/);
  });

  test('ready before any completion: no figures', () => {
    assert.equal(statusView({ state: 'ready', enabled: true }, 'running', true).text, '$(sparkle) specd');
  });

  test('the daemon-wide acceptance stands in until this editor has its own', () => {
    const status: SpecdStatus = { state: 'ready', daemon: { acceptance: { lookup: { proposed: 4, accepted: 1 } } } };
    assert.equal(statusView(status, 'running', true).text, '$(sparkle) specd 25%');
  });

  test('busy states say what is happening', () => {
    for (const [state, words] of [['spawning', 'starting the daemon'], ['loading', 'loading models'], ['connecting', 'connecting']]) {
      const view = statusView({ state }, 'running', true);
      assert.equal(view.level, 'busy', state);
      assert.match(view.tooltip, new RegExp(words), state);
    }
    assert.equal(statusView(undefined, 'starting', true).level, 'busy');
  });

  test('unavailable carries the server\'s reason', () => {
    const view = statusView({ state: 'unavailable', message: 'no daemon answered at /run/specd.sock' }, 'running', true);
    assert.equal(view.level, 'warning');
    assert.equal(view.tooltip, 'specd: daemon unavailable: no daemon answered at /run/specd.sock');
  });

  test('off by the user, or by the server\'s settings', () => {
    assert.equal(statusView(READY, 'running', false).level, 'off');
    assert.equal(statusView({ ...READY, enabled: false }, 'running', true).level, 'off');
  });

  test('a stopped client is an error whatever the last status said', () => {
    assert.equal(statusView(READY, 'stopped', true).level, 'error');
  });
});

describe('formatting', () => {
  test('milliseconds: one decimal under 10, whole above', () => {
    assert.equal(formatMs(3.14159), '3.1 ms');
    assert.equal(formatMs(41.6), '42 ms');
    assert.equal(formatMs(null), undefined);
    assert.equal(formatMs(Number.NaN), undefined);
  });

  test('draft acceptance: undefined before anything was proposed', () => {
    assert.equal(draftAcceptance({}), undefined);
    assert.equal(draftAcceptance(undefined), undefined);
    assert.equal(draftAcceptance({ a: { proposed: 0, accepted: 0 } }), undefined);
    assert.equal(draftAcceptance({ a: { proposed: 3, accepted: 3 }, b: { proposed: 1, accepted: 0 } }), 0.75);
  });

  test('the status report lists what is known and skips what is not', () => {
    const report = statusReport(READY);
    assert.match(report, /^state: ready$/m);
    assert.match(report, /^daemon: pid 4242, specd 0\.1\.0, ready$/m);
    assert.match(report, /^last latency: 42 ms$/m);
    assert.match(report, /^suggestions: 10 shown, 4 accepted, 2 from cache$/m);
    assert.match(statusReport({ ...READY, acceptedPartial: 3 }), /^suggestions: 10 shown, 4 accepted \(and 3 partly\), 2 from cache$/m);
    assert.match(report, /^draft acceptance \(lookup\): 90% of 30$/m);
    assert.doesNotMatch(report, /undefined|null/);
    assert.equal(statusReport({ state: 'connecting' }), 'state: connecting');
  });
});
