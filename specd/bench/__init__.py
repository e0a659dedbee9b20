"""``specd bench``: specd against plain HF ``generate()``, HF assisted generation and HF prompt
lookup, side by side on the same model pair and the same prompts.

- ``workloads``: completions cut from real source files (line, edit_replay, cold);
- ``peers``: the methods compared (HF peers and specd variants), one ``run`` interface;
- ``report``: medians, ratios, acceptance, the text table, the JSON object and the plot;
- ``run``: the CLI entry ``run_bench(args, cfg)``.
"""
