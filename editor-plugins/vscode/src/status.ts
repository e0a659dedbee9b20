// What the status bar and the "show status" command say, from specd/status payloads.
// Pure functions (no `vscode` import) so the wording is unit-tested.

import type { SourceAcceptance, SpecdStatus } from './protocol';

/** The language client's own state, as far as the status bar cares. */
export type ClientState = 'starting' | 'running' | 'stopped';

export type Level = 'ok' | 'busy' | 'warning' | 'error' | 'off';

export interface StatusView {
  text: string;
  tooltip: string;
  level: Level;
}

const ICONS: Record<Level, string> = {
  ok: '$(sparkle)',
  busy: '$(loading~spin)',
  warning: '$(warning)',
  error: '$(error)',
  off: '$(circle-slash)',
};

const BUSY_STATES: Record<string, string> = {
  connecting: 'connecting to the daemon',
  spawning: 'starting the daemon',
  loading: 'loading models',
};

/** Accepted over proposed draft tokens, over all sources; undefined before any were proposed. */
export function draftAcceptance(acceptance: Record<string, SourceAcceptance> | null | undefined): number | undefined {
  let proposed = 0;
  let accepted = 0;
  for (const counts of Object.values(acceptance ?? {})) {
    proposed += counts.proposed ?? 0;
    accepted += counts.accepted ?? 0;
  }
  return proposed > 0 ? accepted / proposed : undefined;
}

export function formatMs(ms: number | null | undefined): string | undefined {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return undefined;
  return ms < 10 ? `${ms.toFixed(1)} ms` : `${Math.round(ms)} ms`;
}

export function formatPercent(rate: number | undefined): string | undefined {
  return rate === undefined ? undefined : `${Math.round(rate * 100)}%`;
}

/** The status bar item: `specd 42 ms · 78%` when ready, the state in words otherwise. */
export function statusView(status: SpecdStatus | undefined, client: ClientState, enabled: boolean): StatusView {
  if (client === 'stopped') {
    return { text: `${ICONS.error} specd`, tooltip: 'specd: the language server is not running (run "specd: Restart Server")', level: 'error' };
  }
  if (!enabled || status?.enabled === false) {
    return { text: `${ICONS.off} specd`, tooltip: 'specd: completions are off (run "specd: Toggle Completions")', level: 'off' };
  }
  if (client === 'starting' || status === undefined) {
    return { text: `${ICONS.busy} specd`, tooltip: 'specd: starting the language server', level: 'busy' };
  }
  const state = status.state ?? 'connecting';
  if (state === 'unavailable' || state === 'stopped') {
    const why = status.message ? `: ${status.message}` : '';
    return { text: `${ICONS.warning} specd`, tooltip: `specd: daemon ${state}${why}`, level: 'warning' };
  }
  if (state in BUSY_STATES) {
    return { text: `${ICONS.busy} specd`, tooltip: `specd: ${BUSY_STATES[state]}`, level: 'busy' };
  }
  const latency = formatMs(status.lastLatencyMs);
  const rate = formatPercent(draftAcceptance(status.acceptance) ?? draftAcceptance(status.daemon?.acceptance));
  const figures = [latency, rate].filter(Boolean).join(' · ');
  return { text: `${ICONS.ok} specd${figures ? ' ' + figures : ''}`, tooltip: tooltip(status), level: 'ok' };
}

function tooltip(status: SpecdStatus): string {
  const lines = [`specd: daemon ${status.state ?? 'unknown'}`];
  const models = status.daemon?.models;
  if (models?.target) lines.push(`model ${models.target}${models.draft ? ` + draft ${models.draft}` : ''}`);
  const latency = formatMs(status.lastLatencyMs);
  if (latency) lines.push(`last completion ${latency}`);
  const rate = formatPercent(draftAcceptance(status.acceptance));
  if (rate) lines.push(`draft tokens accepted ${rate}`);
  if (status.shown) lines.push(`suggestions accepted ${status.accepted ?? 0} of ${status.shown}`);
  return lines.join('\n');
}

/** The full report for "specd: Show Status": one `key: value` line per figure. */
export function statusReport(status: SpecdStatus): string {
  const daemon = status.daemon ?? {};
  const lines: [string, unknown][] = [
    ['state', status.state + (status.message ? ` (${status.message})` : '')],
    ['enabled', status.enabled],
    ['daemon', daemon.pid ? `pid ${daemon.pid}, specd ${daemon.version ?? '?'}, ${daemon.state ?? '?'}` : undefined],
    ['target model', daemon.models?.target],
    ['draft model', daemon.models?.draft],
    ['device', daemon.models?.device],
    ['last latency', formatMs(status.lastLatencyMs)],
    ['daemon latency p50/p95', daemon.latencyMs?.count ? `${formatMs(daemon.latencyMs.p50)} / ${formatMs(daemon.latencyMs.p95)} over ${daemon.latencyMs.count}` : undefined],
    ['suggestions', status.shown !== undefined ? `${status.shown} shown, ${status.accepted ?? 0} accepted${status.acceptedPartial ? ` (and ${status.acceptedPartial} partly)` : ''}, ${status.cacheHits ?? 0} from cache` : undefined],
    ['position encoding', status.positionEncoding],
  ];
  for (const [source, counts] of Object.entries(status.acceptance ?? {})) {
    lines.push([`draft acceptance (${source})`, `${formatPercent(counts.proposed ? counts.accepted / counts.proposed : 0)} of ${counts.proposed}`]);
  }
  return lines
    .filter(([, value]) => value !== undefined && value !== null && value !== '')
    .map(([key, value]) => `${key}: ${value}`)
    .join('\n');
}
