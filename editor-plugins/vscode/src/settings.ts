// The extension's settings (`specd.*`) and what they become: specd-lsp's initializationOptions,
// the server command line and its environment. No `vscode` import, so tests run in plain node.

/** Languages the extension activates on and serves; package.json's activationEvents list the same. */
export const LANGUAGES: readonly string[] = [
  'c', 'cpp', 'csharp', 'css', 'dart', 'dockerfile', 'elixir', 'go', 'haskell', 'html', 'java',
  'javascript', 'javascriptreact', 'json', 'jsonc', 'kotlin', 'lua', 'makefile', 'markdown', 'php',
  'python', 'r', 'ruby', 'rust', 'scala', 'scss', 'shellscript', 'sql', 'swift', 'toml',
  'typescript', 'typescriptreact', 'vue', 'yaml', 'zig',
];

export type TriggerMode = 'automatic' | 'manual';
export type LogLevel = 'debug' | 'info' | 'warning' | 'error';

export interface SpecdSettings {
  enable: boolean;
  languages: string[];
  serverPath: string;
  serverArgs: string[];
  triggerMode: TriggerMode;
  maxTokens: number;
  singleLine: boolean;
  debounceMs: number;
  partialLineMs: number;
  alternatives: number;
  temperature: number;
  daemon: { socket: string; spawn: boolean; spawnTimeoutS: number };
  cache: { typeThrough: boolean; prefetch: boolean };
  model: { target: string; draft: string; device: string };
  log: { level: LogLevel; file: string };
}

/** Every setting's default, keyed by its name under `specd.`; package.json declares the same. */
export const DEFAULTS = {
  'enable': true,
  'languages': [...LANGUAGES],
  'serverPath': 'specd-lsp',
  'serverArgs': [] as string[],
  'triggerMode': 'automatic' as TriggerMode,
  'maxTokens': 64,
  'singleLine': false,
  'debounceMs': 75,
  'partialLineMs': 75,
  'alternatives': 3,
  'temperature': 0.7,
  'daemon.socket': '',
  'daemon.spawn': true,
  'daemon.spawnTimeoutS': 60,
  'cache.typeThrough': true,
  'cache.prefetch': true,
  'model.target': '',
  'model.draft': '',
  'model.device': '',
  'log.level': 'info' as LogLevel,
  'log.file': '',
  'trace.server': 'off',
};

export type SettingName = keyof typeof DEFAULTS;

/** What the extension needs of a vscode.WorkspaceConfiguration (for section `specd`). */
export interface ConfigurationLike {
  get<T>(name: string): T | undefined;
}

/** Settings whose change needs a new server process; the rest are sent to the running one. */
export const RESTART_SETTINGS = ['serverPath', 'serverArgs', 'languages', 'daemon', 'model'];

export function readSettings(config: ConfigurationLike): SpecdSettings {
  const get = <K extends SettingName>(name: K): (typeof DEFAULTS)[K] => {
    const value = config.get<(typeof DEFAULTS)[K]>(name);
    return value === undefined || value === null ? DEFAULTS[name] : value;
  };
  return {
    enable: get('enable'),
    languages: get('languages'),
    serverPath: get('serverPath').trim() || DEFAULTS.serverPath,
    serverArgs: get('serverArgs'),
    triggerMode: get('triggerMode'),
    maxTokens: get('maxTokens'),
    singleLine: get('singleLine'),
    debounceMs: get('debounceMs'),
    partialLineMs: get('partialLineMs'),
    alternatives: get('alternatives'),
    temperature: get('temperature'),
    daemon: { socket: get('daemon.socket'), spawn: get('daemon.spawn'), spawnTimeoutS: get('daemon.spawnTimeoutS') },
    cache: { typeThrough: get('cache.typeThrough'), prefetch: get('cache.prefetch') },
    model: { target: get('model.target'), draft: get('model.draft'), device: get('model.device') },
    log: { level: get('log.level'), file: get('log.file') },
  };
}

/**
 * specd-lsp's settings (its initializationOptions and didChangeConfiguration payload), camelCase
 * as lsp/specd_lsp/options.py reads them. The server checks types and ranges itself and names any
 * value it ignored in one message, so nothing is validated twice here.
 */
export function serverSettings(settings: SpecdSettings): Record<string, unknown> {
  return {
    enable: settings.enable,
    triggerMode: settings.triggerMode,
    maxTokens: settings.maxTokens,
    singleLine: settings.singleLine,
    debounceMs: settings.debounceMs,
    partialLineMs: settings.partialLineMs,
    alternatives: settings.alternatives,
    temperature: settings.temperature,
    daemon: { ...settings.daemon },
    cache: { ...settings.cache },
    log: { ...settings.log },
  };
}

export interface ServerLaunch {
  command: string;
  args: string[];
  env: Record<string, string | undefined>;
}

/**
 * The server process: `specd.serverPath` (a name looked up on PATH, or a path) with its args, in
 * the editor's environment. Model settings travel as SPECD_MODEL_* variables: specd-lsp hands its
 * environment to the daemon it starts, and specd's config reads them (a daemon already running
 * keeps the models it has).
 */
export function serverLaunch(settings: SpecdSettings, baseEnv: Record<string, string | undefined>): ServerLaunch {
  const env = { ...baseEnv };
  const model: [string, string][] = [
    ['SPECD_MODEL_TARGET', settings.model.target],
    ['SPECD_MODEL_DRAFT', settings.model.draft],
    ['SPECD_MODEL_DEVICE', settings.model.device],
  ];
  for (const [name, value] of model) {
    if (value.trim()) env[name] = value.trim();
  }
  return { command: expandHome(settings.serverPath, baseEnv.HOME), args: [...settings.serverArgs], env };
}

function expandHome(path: string, home: string | undefined): string {
  return home && (path === '~' || path.startsWith('~/')) ? home + path.slice(1) : path;
}

/** The documents the client syncs and asks about: files and unsaved buffers of the languages. */
export function documentSelector(languages: readonly string[]): { language: string; scheme: string }[] {
  return languages.flatMap((language) => [
    { language, scheme: 'file' },
    { language, scheme: 'untitled' },
  ]);
}

/** Whether a configuration change (as `affectsConfiguration` answers it) needs a server restart. */
export function needsRestart(affects: (section: string) => boolean): boolean {
  return RESTART_SETTINGS.some((name) => affects(`specd.${name}`));
}

/** Where `specd.serverPath` took its value from (vscode's `inspect()`, most specific first). */
export interface SettingOrigin {
  folder?: unknown;
  workspace?: unknown;
  user?: unknown;
}

/** The one message shown when specd-lsp does not start: which value was tried, where it came
 *  from, on which host it ran, and where to set it (a remote window runs it on the remote host). */
export function startFailureMessage(serverPath: string, origin: SettingOrigin, remoteName: string | undefined): string {
  const from = origin.folder !== undefined ? 'Folder settings'
    : origin.workspace !== undefined ? 'Workspace settings'
      : origin.user !== undefined ? 'User settings' : 'the default';
  const host = remoteName ? ` on the remote host (${remoteName})` : '';
  const where = remoteName
    ? 'set `specd.serverPath` to its path on that host, in User or Remote settings'
    : 'set `specd.serverPath` to its full path in User settings';
  return `specd: could not start \`${serverPath}\`${host} (specd.serverPath from ${from}): install specd there or ${where}.`;
}
