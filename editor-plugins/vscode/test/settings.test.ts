import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  DEFAULTS, documentSelector, LANGUAGES, needsRestart, readSettings, serverLaunch, serverSettings, startFailureMessage,
} from '../src/settings';
import { fakeConfig } from './helpers';

describe('settings → initializationOptions', () => {
  test('defaults map to the server defaults, camelCase and nested as lsp/specd_lsp/options.py reads them', () => {
    assert.deepEqual(serverSettings(readSettings(fakeConfig())), {
      enable: true,
      triggerMode: 'automatic',
      maxTokens: 64,
      singleLine: false,
      debounceMs: 75,
      partialLineMs: 75,
      alternatives: 3,
      temperature: 0.7,
      daemon: { socket: '', spawn: true, spawnTimeoutS: 60 },
      cache: { typeThrough: true, prefetch: true },
      log: { level: 'info', file: '' },
    });
  });

  test('user values replace defaults, including nested ones', () => {
    const options = serverSettings(readSettings(fakeConfig({
      enable: false, triggerMode: 'manual', maxTokens: 16, singleLine: true, 'daemon.spawn': false,
      'daemon.socket': '/run/user/1000/specd/specd.sock', 'cache.prefetch': false, 'log.level': 'debug',
    })));
    assert.equal(options.enable, false);
    assert.equal(options.triggerMode, 'manual');
    assert.equal(options.maxTokens, 16);
    assert.equal(options.singleLine, true);
    assert.deepEqual(options.daemon, { socket: '/run/user/1000/specd/specd.sock', spawn: false, spawnTimeoutS: 60 });
    assert.deepEqual(options.cache, { typeThrough: true, prefetch: false });
    assert.deepEqual(options.log, { level: 'debug', file: '' });
  });

  test('editor-only settings stay out of the server options', () => {
    const options = serverSettings(readSettings(fakeConfig({ serverPath: '/opt/specd-lsp', 'model.target': 'm' })));
    for (const key of ['serverPath', 'serverArgs', 'languages', 'model', 'trace']) {
      assert.equal(key in options, false, key);
    }
  });

  test('null (a reset setting) falls back to the default', () => {
    assert.equal(readSettings(fakeConfig({ maxTokens: null, serverPath: '  ' })).maxTokens, 64);
    assert.equal(readSettings(fakeConfig({ serverPath: '  ' })).serverPath, 'specd-lsp');
  });
});

describe('server launch', () => {
  test('specd-lsp from PATH by default, in the editor environment', () => {
    const launch = serverLaunch(readSettings(fakeConfig()), { PATH: '/usr/bin', HOME: '/home/u' });
    assert.equal(launch.command, 'specd-lsp');
    assert.deepEqual(launch.args, []);
    assert.deepEqual(launch.env, { PATH: '/usr/bin', HOME: '/home/u' });
  });

  test('serverPath with ~ and args', () => {
    const launch = serverLaunch(readSettings(fakeConfig({ serverPath: '~/.venvs/specd/bin/specd-lsp', serverArgs: ['--log-level', 'debug'] })),
      { HOME: '/home/u' });
    assert.equal(launch.command, '/home/u/.venvs/specd/bin/specd-lsp');
    assert.deepEqual(launch.args, ['--log-level', 'debug']);
  });

  test('model settings become SPECD_MODEL_* for a daemon the server starts; empty ones are left out', () => {
    const base = { SPECD_MODEL_DEVICE: 'cuda:1' };
    const launch = serverLaunch(readSettings(fakeConfig({ 'model.target': ' Qwen/Qwen2.5-Coder-1.5B ', 'model.draft': '/m/draft' })), base);
    assert.equal(launch.env.SPECD_MODEL_TARGET, 'Qwen/Qwen2.5-Coder-1.5B');
    assert.equal(launch.env.SPECD_MODEL_DRAFT, '/m/draft');
    assert.equal(launch.env.SPECD_MODEL_DEVICE, 'cuda:1');
    assert.deepEqual(base, { SPECD_MODEL_DEVICE: 'cuda:1' }, 'the base environment is not modified');
  });
});

describe('documents and restarts', () => {
  test('the selector covers files and unsaved buffers of each language', () => {
    assert.deepEqual(documentSelector(['python']), [{ language: 'python', scheme: 'file' }, { language: 'python', scheme: 'untitled' }]);
    assert.equal(documentSelector(LANGUAGES).length, 2 * LANGUAGES.length);
  });

  test('server process settings restart it; the others are sent to it', () => {
    const affects = (changed: string) => (section: string) => changed === section || changed.startsWith(section + '.');
    assert.equal(needsRestart(affects('specd.serverPath')), true);
    assert.equal(needsRestart(affects('specd.model.target')), true);
    assert.equal(needsRestart(affects('specd.daemon.socket')), true);
    assert.equal(needsRestart(affects('specd.maxTokens')), false);
    assert.equal(needsRestart(affects('specd.enable')), false);
  });

  test('DEFAULTS name every setting once', () => {
    assert.equal(new Set(Object.keys(DEFAULTS)).size, Object.keys(DEFAULTS).length);
  });
});

describe('when specd-lsp does not start', () => {
  test('a remote window says the path is looked up on the remote host and where to set it', () => {
    const message = startFailureMessage('/home/me/.venv/bin/specd-lsp', { user: '/home/me/.venv/bin/specd-lsp' }, 'ssh-remote');
    assert.match(message, /could not start `\/home\/me\/\.venv\/bin\/specd-lsp` on the remote host \(ssh-remote\)/);
    assert.match(message, /from User settings/);
    assert.match(message, /User or Remote settings/);
  });

  test('a local window names the value tried and where it came from', () => {
    assert.match(startFailureMessage('specd-lsp', {}, undefined), /`specd-lsp` \(specd\.serverPath from the default\).*full path in User settings/);
    assert.match(startFailureMessage('x', { user: 'y', workspace: 'x' }, undefined), /from Workspace settings/);
  });
});
