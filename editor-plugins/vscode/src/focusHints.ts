// When to tell specd-lsp where the cursor came to rest (specd/didFocus), free of the vscode API
// so that its rules are unit-tested: once the cursor has been still for FOCUS_DEBOUNCE_MS, once
// per document and line (a move along the line keeps most of the prompt the daemon prefills), and
// not for a cursor moved by an edit (while the user types, the edits tell the daemon where).

/** A run of moves (search, scrolling, holding an arrow key) sends only where it stopped. */
export const FOCUS_DEBOUNCE_MS = 100;

/** A cursor: the document's URI and an LSP position (negotiated encoding). */
export interface Focus {
  uri: string;
  line: number;
  character: number;
}

export class FocusHints {
  private readonly sentLine = new Map<string, number>(); // per document, the line last sent
  private readonly seenVersion = new Map<string, number>(); // per document, its version at the last move
  private pending: Focus | undefined;
  private timer: ReturnType<typeof setTimeout> | undefined;

  /** `send` returns whether the hint went out (a client not running drops it, and it counts as unsent). */
  constructor(private readonly send: (focus: Focus) => boolean, private readonly delayMs = FOCUS_DEBOUNCE_MS) {}

  /**
   * The cursor is at `focus` in a document at `version`. `entered`: the editor became the active
   * one (always a hint); otherwise a move that came with an edit is typing, and cancels the hint.
   */
  moved(focus: Focus, version: number, entered = false): void {
    const seen = this.seenVersion.get(focus.uri);
    this.seenVersion.set(focus.uri, version);
    if (!entered && seen !== undefined && seen !== version) {
      this.cancel();
      return;
    }
    this.cancel();
    this.pending = focus;
    this.timer = setTimeout(() => this.flush(), this.delayMs);
  }

  /** The document was closed: a hint after it opens again is news to the daemon. */
  forget(uri: string): void {
    this.sentLine.delete(uri);
    this.seenVersion.delete(uri);
    if (this.pending?.uri === uri) this.cancel();
  }

  dispose(): void {
    this.cancel();
  }

  private cancel(): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
    this.pending = undefined;
  }

  private flush(): void {
    const focus = this.pending;
    this.timer = undefined;
    this.pending = undefined;
    if (focus === undefined || this.sentLine.get(focus.uri) === focus.line) return;
    if (this.send(focus)) this.sentLine.set(focus.uri, focus.line);
  }
}
