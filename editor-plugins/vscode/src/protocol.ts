// specd-lsp's custom protocol, named once (the server defines the same strings in lsp/specd_lsp/server.py).

/** Request (full status) and notification (sent on changes). */
export const STATUS_METHOD = 'specd/status';
/** The command each inline item carries; the server counts the accept and prefetches. */
export const ACCEPTED_COMMAND = 'specd.accepted';

/** Link states of specd-lsp's connection to the daemon. */
export type LinkState = 'connecting' | 'spawning' | 'loading' | 'ready' | 'unavailable' | 'stopped';

export interface SourceAcceptance {
  proposed: number;
  accepted: number;
  rate?: number;
}

/** The `specd/status` payload (request result and notification params). Every field may be missing. */
export interface SpecdStatus {
  state?: LinkState | string;
  message?: string;
  enabled?: boolean;
  positionEncoding?: string;
  documents?: number;
  daemon?: {
    pid?: number | null;
    version?: string | null;
    state?: string | null;
    models?: { target?: string; draft?: string; device?: string } | null;
    latencyMs?: { count?: number; p50?: number; p95?: number; max?: number } | null;
    acceptance?: Record<string, SourceAcceptance> | null;
    connects?: number;
  };
  requests?: number;
  shown?: number;
  accepted?: number;
  /** Words or lines of a suggestion taken (an editor plugin that reports them; see docs/lsp.md). */
  acceptedPartial?: number;
  acceptedChars?: number;
  cacheHits?: number;
  lastLatencyMs?: number | null;
  lastStopReason?: string | null;
  /** Draft tokens proposed and accepted by the target, per drafting source (this editor's requests). */
  acceptance?: Record<string, SourceAcceptance>;
  settings?: Record<string, unknown>;
}

/** Notification: the item last answered at this document version and position grew; ask again. */
export const GREW_METHOD = 'specd/suggestionGrew';

export interface SuggestionGrew {
  uri: string;
  version: number;
  position: { line: number; character: number };
}

export interface EditorAt {
  uri: string;
  version: number;
  line: number;
  character: number;
}

/** Whether the notice is about where the user is now (anything else has moved on). */
export function isAt(note: SuggestionGrew, editor: EditorAt | undefined): boolean {
  return editor !== undefined && note.uri === editor.uri && note.version === editor.version &&
    note.position?.line === editor.line && note.position?.character === editor.character;
}

/**
 * Notification to specd-lsp: the cursor came to rest in this document (it was entered, or the
 * cursor jumped there); the daemon prefills there in idle time, so the first suggestion does not
 * wait for the prompt. Position in the negotiated encoding, as every LSP position.
 */
export const FOCUS_METHOD = 'specd/didFocus';

export interface DidFocusParams {
  textDocument: { uri: string };
  position: { line: number; character: number };
}
