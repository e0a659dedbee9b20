// package.json is part of the extension's logic: activation, settings, keybindings.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { DEFAULTS, LANGUAGES } from '../src/settings';

const ROOT = join(__dirname, '..', '..');
const manifest = JSON.parse(readFileSync(join(ROOT, 'package.json'), 'utf8'));
const properties: Record<string, { default: unknown; scope?: string }> = manifest.contributes.configuration.properties;

describe('package.json', () => {
  test('activates on the listed languages only: never "*" or on startup', () => {
    assert.deepEqual(manifest.activationEvents, LANGUAGES.map((language) => `onLanguage:${language}`));
  });

  test('declares exactly the settings settings.ts reads, with the same defaults', () => {
    assert.deepEqual(Object.keys(properties).sort(), Object.keys(DEFAULTS).map((name) => `specd.${name}`).sort());
    for (const [name, value] of Object.entries(DEFAULTS)) {
      assert.deepEqual(properties[`specd.${name}`].default, value, name);
    }
  });

  test('every setting has a scope; enable is language-overridable', () => {
    for (const [name, property] of Object.entries(properties)) {
      assert.ok(property.scope, `${name} has no scope`);
    }
    assert.equal(properties['specd.enable'].scope, 'language-overridable');
  });

  test('no setting is machine-scoped: in a remote window (code-server, Remote-SSH, WSL) VS Code ignores those in User settings', () => {
    for (const [name, property] of Object.entries(properties)) {
      assert.ok(!String(property.scope).startsWith('machine'), `${name}: scope ${property.scope}`);
    }
  });

  test('keybindings only act while specd is on and never while another widget owns the keys', () => {
    for (const binding of manifest.contributes.keybindings) {
      assert.match(binding.when, /specd\.enabled/, binding.command);
      assert.match(binding.when, /editorTextFocus/, binding.command);
      assert.notEqual(binding.key, 'tab', 'Tab belongs to VS Code\'s own accept');
    }
  });

  test('every contributed command has a handler name in the specd namespace', () => {
    const commands = manifest.contributes.commands.map((c: { command: string }) => c.command);
    assert.deepEqual(commands.sort(), ['specd.restart', 'specd.showLog', 'specd.showStatus', 'specd.toggle']);
  });

  test('an untrusted workspace cannot choose the program or models specd runs', () => {
    const untrusted = manifest.capabilities.untrustedWorkspaces;
    assert.equal(untrusted.supported, 'limited');
    for (const name of ['specd.serverPath', 'specd.serverArgs', 'specd.model.target', 'specd.model.draft']) {
      assert.ok(untrusted.restrictedConfigurations.includes(name), name);
    }
  });

  test('the bundle is the entry point', () => {
    assert.equal(manifest.main, './dist/extension.js');
  });
});
