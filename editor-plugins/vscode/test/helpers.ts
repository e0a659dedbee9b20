// Test helpers: a fake WorkspaceConfiguration, bounded waits, and a specd environment (tiny models,
// private XDG dirs) for the integration test.

import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import type { ConfigurationLike } from '../src/settings';

/** The repository root (this file runs from editor-plugins/vscode/out/test/). */
export const REPO = resolve(__dirname, '..', '..', '..', '..');

/** A WorkspaceConfiguration stand-in holding the user's `specd.*` values (names without `specd.`). */
export function fakeConfig(values: Record<string, unknown> = {}): ConfigurationLike {
  return { get: <T>(name: string) => values[name] as T | undefined };
}

/**
 * Polls `condition` every `intervalMs` until it returns a truthy value; fails after `timeoutMs`.
 * `what` may be a function, so the failure message shows the state at the time of failure.
 */
export async function waitFor<T>(condition: () => T | undefined | null | false, timeoutMs: number,
  what: string | (() => string), intervalMs = 20): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = condition();
    if (value) return value;
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${typeof what === 'string' ? what : what()}`);
    }
    await new Promise((resolveTimer) => setTimeout(resolveTimer, intervalMs));
  }
}

/** The Python that has specd installed: $SPECD_TEST_PYTHON, the repo's .venv, or python3. */
export function pythonPath(): string {
  const venv = join(REPO, '.venv', 'bin', 'python');
  return process.env.SPECD_TEST_PYTHON || (existsSync(venv) ? venv : 'python3');
}

/** specd-lsp: $SPECD_TEST_LSP, next to that Python, or on PATH. (Not SPECD_LSP: specd's config
 *  reads every other SPECD_* variable as a setting and refuses unknown ones.) */
export function serverPath(): string {
  const beside = join(dirname(pythonPath()), 'specd-lsp');
  return process.env.SPECD_TEST_LSP || (existsSync(beside) ? beside : 'specd-lsp');
}

export interface SpecdEnvironment {
  env: NodeJS.ProcessEnv;
  /** Stops a daemon this environment's specd-lsp started, and removes the private dirs. */
  cleanup(): void;
}

const TINY_BUILD_TIMEOUT_MS = 300_000;
const STOP_TIMEOUT_MS = 30_000;

/**
 * Where specd-lsp finds (or starts) its daemon. With SPECD_TEST_SHARED_DAEMON=1 the caller's
 * environment already points at a running daemon (tests/test_editor_plugins.py does this).
 * Otherwise: private XDG dirs and a tiny random-weight model pair (tests/tiny.py), so the
 * specd-lsp under test starts its own daemon on them, as it would for a user.
 */
export function specdEnvironment(): SpecdEnvironment {
  if (process.env.SPECD_TEST_SHARED_DAEMON === '1') {
    return { env: { ...process.env }, cleanup: () => undefined };
  }
  const root = mkdtempSync(join(tmpdir(), 'specd-vscode-test-'));
  const env: NodeJS.ProcessEnv = Object.fromEntries(Object.entries(process.env).filter(([name]) => !name.startsWith('SPECD_')));
  for (const [name, sub] of [['XDG_RUNTIME_DIR', 'run'], ['XDG_STATE_HOME', 'state'], ['XDG_CONFIG_HOME', 'config'], ['XDG_CACHE_HOME', 'cache']]) {
    env[name] = join(root, sub);
    mkdirSync(env[name]!, { recursive: true, mode: 0o700 });
  }
  const tiny = join(tmpdir(), 'specd-vscode-tiny-llama'); // kept between runs: built in code, ~10 s
  const built = spawnSync(pythonPath(), [join(REPO, 'tests', 'tiny.py'), tiny, 'llama'], { encoding: 'utf8', timeout: TINY_BUILD_TIMEOUT_MS });
  if (built.status !== 0) throw new Error(`tests/tiny.py failed (${built.status ?? built.signal}):\n${built.stderr}`);
  Object.assign(env, {
    SPECD_MODEL_TARGET: join(tiny, 'target'),
    SPECD_MODEL_DRAFT: join(tiny, 'draft'),
    SPECD_MODEL_DEVICE: 'cpu',
  });
  return {
    env,
    cleanup: () => {
      spawnSync(pythonPath(), ['-m', 'specd', 'stop'], { env, timeout: STOP_TIMEOUT_MS });
      rmSync(root, { recursive: true, force: true });
    },
  };
}
