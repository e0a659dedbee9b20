"""The ``specd`` command line.

Each subcommand parses its flags here and hands off to the module that owns the work
(engine, daemon, bench, demo). Heavy imports (torch, transformers) happen inside the
handlers, so ``specd --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from specd import __version__
from specd.config import DEVICE_NAMES, ConfigError, load_config

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what `yes | head` reports for `yes`
# specd.llamacpp.export.EXPORT_TYPES, spelled out so that building the parser imports nothing
# heavy (tests/test_gguf_models.py keeps the two in step)
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_0", "q5_1", "q4_k_m", "q4_k_s",
              "q4_0", "q4_1", "q3_k_m", "q2_k")

DESCRIPTION = """\
specd keeps a code model pair (target + draft) resident and answers fill-in-the-middle
completions with lossless speculative decoding: drafts come from a small draft model and
from prompt lookup over your open buffers, and the target verifies them in one forward pass.

Config: $XDG_CONFIG_HOME/specd/config.toml, overridden by SPECD_<SECTION>_<KEY> environment
variables, overridden by flags. `specd doctor` shows the effective values and their sources.
"""


def _model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", metavar="MODEL", help="target model: a local dir or hub id, a .gguf file, "
                                                      "or ollama:NAME[:TAG] (the GGUF file Ollama pulled)")
    group.add_argument("--draft-model", metavar="MODEL", help="draft model sharing the target's tokenizer "
                                                            "(a .gguf file when the target is one)")
    group.add_argument("--device", help=f"torch device: {DEVICE_NAMES}")
    group.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="weights dtype")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags as config overrides (None means 'not given')."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    return {
        "model.target": get("model"),
        "model.draft": get("draft_model"),
        "model.device": get("device"),
        "model.dtype": get("dtype"),
        "model.fim_layout": get("fim_layout"),
        "engine.token_healing": None if get("token_healing") is None else get("token_healing") == "on",
        "log.level": get("log_level"),
        "daemon.socket": get("socket"),
        "daemon.tcp": get("tcp"),
        "daemon.idle_unload_s": get("idle_unload"),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specd", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"specd {__version__}")
    parser.add_argument("--config", metavar="FILE", help="config file (default: $XDG_CONFIG_HOME/specd/config.toml)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="log level")
    parser.add_argument("--socket", metavar="PATH",
                        help="daemon socket, an absolute path (default: $XDG_RUNTIME_DIR/specd/specd.sock)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="run the daemon in the foreground",
                       description="Load the model pair once and serve completions on the local socket.")
    _model_flags(p)
    p.add_argument("--idle-unload", type=int, metavar="SECONDS", help="release models after this idle time (0 = never)")
    p.add_argument("--tcp", metavar="HOST:PORT", help="also listen on loopback TCP (needs daemon.tcp_token)")

    p = sub.add_parser("complete", help="complete a file at a position and print the completion",
                       description="Complete FILE at --line/--col. Goes through a running daemon when one "
                                   "answers (starting one unless --no-spawn or --local); --local runs the "
                                   "engine in this process.")
    p.add_argument("file", help="source file to complete in")
    p.add_argument("--line", type=int, required=True, help="cursor line, 1-based")
    p.add_argument("--col", type=int, required=True, help="cursor column in characters, 0-based")
    _model_flags(p)
    p.add_argument("--max-tokens", type=int, help="most tokens to generate")
    p.add_argument("--no-draft", action="store_true", help="don't use the draft model")
    p.add_argument("--no-lookup", action="store_true", help="don't use prompt lookup")
    p.add_argument("--single-line", action="store_true", help="stop at the end of the line")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print a JSON object with text, prompt_ids, token_ids, stats")
    p.add_argument("--local", action="store_true", help="run the engine in this process, no daemon")
    p.add_argument("--no-spawn", action="store_true", help="don't start a daemon when none runs")

    p = sub.add_parser("status", help="show the running daemon's state",
                       description="Ask the daemon for its models, device, memory, caches, acceptance, latency.")
    p.add_argument("--json", action="store_true", help="print JSON")

    sub.add_parser("stop", help="ask the running daemon to shut down gracefully",
                   description="Send `shutdown` to the daemon on the socket: in-flight requests get their "
                               "answers, then it exits and removes the socket file.")

    p = sub.add_parser("bench", help="measure specd against HF generate, assisted generation, prompt lookup and "
                                     "llama.cpp",
                       description="Run workloads from real source files through plain HF generate() (cold, and "
                                   "with a per-document prefix cache as llama.cpp's cache_prompt), HF assisted "
                                   "generation (transformers' defaults: up to 20 draft tokens per step, constant "
                                   "schedule, drafting stops below 0.4 draft confidence), HF prompt lookup, "
                                   "llama.cpp on a GGUF of the same weights (llamacpp, llamacpp_lookup; with "
                                   "llama-cpp-python installed) and specd (on the forward engine.forward_backend "
                                   "chooses, auto by default; on llama.cpp's forward; and ablations), side by side on the same models and prompts; print ratios. "
                                   "With a GGUF target (--model x.gguf) the reference is llama.cpp's own greedy of "
                                   "that file and the methods are the llama.cpp peers and specd.")
    _model_flags(p)
    p.add_argument("--fim-layout", choices=("auto", "psm", "spm", "anchored"),
                   help="force the engine's FIM prompt layout (model.fim_layout); the report records the "
                        "layout in effect")
    p.add_argument("--token-healing", choices=("on", "off"),
                   help="token healing at the cursor (engine.token_healing; default on): every method gets the "
                        "same healed prompt and the same constraint on its first tokens")
    p.add_argument("--corpus", metavar="DIR", help="source files to build workloads from (default: held-out stdlib modules)")
    p.add_argument("--workloads", default="line,edit_replay,cold,multi_file",
                   help="comma-separated: line, edit_replay, cold, multi_file")
    p.add_argument("--methods", help="comma-separated subset of methods to run (the reference always runs: "
                                     "hf_greedy, or llamacpp on a GGUF target, where no hf_* method can run)")
    p.add_argument("--limit", type=int, default=12,
                   help="completions per workload; edit_replay makes max(2N, 24) requests, at most 6 per "
                        "edited function, so at least 4 functions (default: 12)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per completion")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="write a latency CDF and speedup plot")
    p.add_argument("--seed", type=int, default=0, help="workload sampling seed")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: engine.threads; 1 is "
                                                            "steadier on a busy machine)")
    p.add_argument("--idle-ms", type=float, default=0, metavar="MS",
                   help="before each request on a document it has seen, specd methods hear the edit and get "
                        "this much untimed idle time, as the daemon does during specd-lsp's debounce (75 ms): "
                        "its idle prefill brings the target's and draft's caches to the cursor. Peers get "
                        "nothing (llama-server and generate() do not see edits). Default 0")
    p.add_argument("--costs", default="measured", metavar="PROFILE",
                   help="what specd's planner prices forwards at: measured (this machine's; default), or gpu (a 7B "
                        "model on an H100: a verify of up to 8 tokens 1.05x a step); outputs stay the same, and "
                        "the report adds each method's decode forwards priced at those costs (projected)")
    p.add_argument("--no-forward-costs", action="store_true",
                   help="skip measuring what one forward costs per forward path, width and context (quicker runs)")
    p.add_argument("--forward-costs-only", action="store_true",
                   help="only measure and print the forward costs: ms by forward path (hf, lean), width and "
                        "context, prefill per 1k tokens")

    p = sub.add_parser("eval", help="score what the editor would show against deleted text of real files",
                       description="Completion quality: text deleted at five kinds of cursor (fresh indented "
                                   "line, end of a partly typed line, inside a call's brackets, first line of a "
                                   "body, the same with a twin in the workspace) in real source files, "
                                   "completed by the engine, post-processed as specd-lsp does, scored (exact "
                                   "first line, edit similarity, parses, stray whitespace, re-typed closers, "
                                   "empty, repeated lines, re-typed next lines), per variant side by side: token "
                                   "healing on/off, each FIM layout the family serves, repo context on/off; and "
                                   "per cursor kind, what each suggestion boundary (repeated line, suffix line, "
                                   "block end, current line) cut and what that did to the scores.")
    _model_flags(p)
    p.add_argument("--corpus", metavar="DIR", help="source files (default: held-out stdlib modules)")
    p.add_argument("--kinds", help="comma-separated: fresh_line, line_end, mid_line, body_first, multi_file")
    p.add_argument("--variants", help="comma-separated: healing, no_healing, psm, anchored, spm, context, "
                                      "no_context, plain_window (the same model given a plain prefix/suffix "
                                      "window, no healing, no boundaries: what llama.vim sends), window_128, window_256, "
                                      "window_512 (the narrow window a cold document's first suggestions "
                                      "answer from, engine.first_suggestion_ms) (default: all the family serves)")
    p.add_argument("--limit", type=int, default=10, help="cases per cursor kind (default: 10)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per completion")
    p.add_argument("--seed", type=int, default=0, help="case sampling seed")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object (with every completion)")
    p.add_argument("--plot", metavar="PNG", help="write bar charts per metric, cursor kind and variant")

    p = sub.add_parser("export-gguf", help="write the model pair as GGUF files for llama.cpp",
                       description="Write the configured target and draft (default: the embedded demo pair) "
                                   "as GGUF files with the same token ids, for llama.cpp / llama-server and "
                                   "the bench's llama.cpp peers (Llama, Mistral and Qwen2 architectures with "
                                   "byte-level BPE tokenizers). With llama-cpp-python installed, checks that "
                                   "llama.cpp tokenizes a sample as transformers does.")
    _model_flags(p)
    p.add_argument("--out", metavar="DIR", help="output folder (default: $XDG_CACHE_HOME/specd/gguf)")
    p.add_argument("--type", choices=GGUF_TYPES, default="f32", dest="gguf_type", metavar="TYPE",
                   help="tensor type of the matrices in the file: f32 (default), f16, or one llama.cpp's "
                        f"quantizer writes ({', '.join(GGUF_TYPES[2:])})")
    p.add_argument("--pre-tokenizer", metavar="NAME",
                   help="llama.cpp's pre-tokenizer name (qwen2, llama-bpe, gpt-2, starcoder, ...) when "
                        "it is not detected")

    p = sub.add_parser("install-service", help="install the systemd user units",
                       description="Write specd.socket and specd.service into the user unit directory.")
    p.add_argument("--enable", action="store_true", help="also run systemctl --user daemon-reload and enable --now")
    p.add_argument("--unit-dir", metavar="DIR", help="where to write (default: $XDG_CONFIG_HOME/systemd/user)")

    p = sub.add_parser("doctor", help="print the effective config, the device, and whether the models load",
                       description="Show each config value and where it came from, the torch device found, "
                                   "and try loading the configured models.")
    _model_flags(p)
    p.add_argument("--no-load", action="store_true", help="skip loading the models")

    p = sub.add_parser("train-demo", help="train the embedded demo model pair (CPU, about an hour)",
                       description="Train a byte-level BPE tokenizer and a target + draft model pair on the "
                                   "Python standard library (minus held-out modules) with a FIM objective.")
    from specd.demo.options import add_arguments as train_demo_arguments  # light: no trainer, no torch

    train_demo_arguments(p)

    p = sub.add_parser("train-draft", help="distil a draft model for a target from its own predictions on code",
                       description="Distil a small draft that shares the target's tokenizer: the target runs once "
                                   "over the corpus (its top-k next-token distributions kept), a narrow Llama "
                                   "started from the target's embeddings learns them within --minutes, and "
                                   "TRAINING.md beside the weights says how often it agrees with the target on "
                                   "held-out code, what its step costs against the target's on each forward path, "
                                   "and the tokens per forward that predicts. With --head it trains a feature head "
                                   "instead (EAGLE's draft: one layer reading the target's final hidden state). "
                                   "Ctrl-C saves a checkpoint in --out; the same command goes on from it.")
    from specd.distill.train import add_arguments as train_draft_arguments  # light: no torch at import

    train_draft_arguments(p)
    return parser


def _handler(command: str) -> Callable[[argparse.Namespace, Any], int]:
    if command == "doctor":
        from specd.doctor import run_doctor
        return run_doctor
    if command == "complete":
        from specd.complete_cmd import run_complete
        return run_complete
    if command in ("serve", "status", "stop", "install-service"):
        from specd.daemon import commands
        return getattr(commands, command.replace("-", "_"))
    if command == "bench":
        from specd.bench.run import run_bench
        return run_bench
    if command == "eval":
        from specd.bench.evaluate import run_eval
        return run_eval
    if command == "export-gguf":
        from specd.llamacpp.export import run_export_gguf
        return run_export_gguf
    if command == "train-demo":
        from specd.demo.train import run_train_demo
        return run_train_demo
    if command == "train-draft":
        from specd.distill.train import run_train_draft
        return run_train_draft
    raise AssertionError(command)


def _stdout_closed() -> int:
    """The reader of our stdout went away (`specd status | head`): stop quietly, as `cat` would.

    Python would print a BrokenPipeError traceback, and again when it flushes stdout at exit;
    pointing stdout at /dev/null stops the second one.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            code = _main(argv)
        except SystemExit:  # argparse's --help, --version and usage errors
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback when Python exits
        return code
    except BrokenPipeError:
        return _stdout_closed()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    try:
        cfg = load_config(args.config, overrides=_overrides(args))
    except ConfigError as err:
        print(f"specd: config error: {err}", file=sys.stderr)
        return EXIT_USAGE
    for warning in cfg.warnings:
        print(f"specd: warning: {warning}", file=sys.stderr)
    from specd.logs import StateFileError, setup_logging

    setup_logging(cfg["log.level"], cfg.log_file)
    try:
        return _handler(args.command)(args, cfg) or 0
    except ConfigError as err:
        print(f"specd: config error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except StateFileError as err:  # a state file that cannot be used (the spawn log a FIFO): say what to fix
        print(f"specd: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
