"""The report: the tables' numbers over seeds with paired tests (table), the figures (figures, styles) and
the report command that writes tables as Markdown, LaTeX and CSV beside them (build)."""
