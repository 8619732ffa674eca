"""The paper's tables as FusionBench commands: the catalog of rows, the paper's numbers, a resumable runner,
and renderers (Markdown, LaTeX, CSV). The command line is ``experiments/scripts/reproduce.py``."""
