"""A config file with broken YAML: Snakemake's error names the file, line and column.

Snakemake reads every --configfile before it runs the Snakefile, and when the YAML does not parse
it says only "Config file is not valid JSON or YAML. In case of YAML, make sure to not mix whitespace
and tab indentation.", dropping the parser's own account of where and what (and the tab hint is
usually wrong). Nothing of the workflow runs before that point, but Snakemake imports every
installed executor plugin while it builds its command line, earlier still: so this plugin is where
klstudy can put the position back, for any executor. `install()` wraps Snakemake's loader so that
this one error is raised again with the position; everything else passes through unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path


def yaml_error_message(source: object, error) -> str:
    """`study config: <file>, line L, column C: <problem> (<context>; fix the YAML there)`."""
    mark = error.problem_mark
    where = f"{source if isinstance(source, (str, Path)) else 'the config file'}, line {mark.line + 1}, " \
            f"column {mark.column + 1}"
    context = ""
    if error.context and error.context_mark is not None:
        start = error.context_mark
        context = f"{error.context}, from line {start.line + 1}, column {start.column + 1}; "
    tab = "'\\t'" in str(error.problem)  # the scanner shows the character it refused escaped
    fix = "indent with spaces: YAML allows no tabs" if tab else "fix the YAML there"
    return f"study config: {where}: {error.problem} ({context}{fix})"


def _marked(error: BaseException, kind: type) -> BaseException | None:
    """The YAML parser's own error behind `error`, with its position (yte raises a copy without one)."""
    seen = error.__cause__ or error.__context__
    while seen is not None:
        if isinstance(seen, kind) and seen.problem_mark is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def install() -> None:
    """Wrap snakemake.common.configfile._load_configfile (idempotent; a Snakemake without it is left alone)."""
    try:
        import yaml
        from snakemake.common import configfile
        from snakemake_interface_common.exceptions import WorkflowError
    except ImportError:
        return
    load = getattr(configfile, "_load_configfile", None)
    if load is None or getattr(load, "_klstudy", False):
        return

    @functools.wraps(load)
    def load_with_position(configpath_or_obj, *args, **kwargs):
        try:
            return load(configpath_or_obj, *args, **kwargs)
        except WorkflowError as error:
            cause = _marked(error, yaml.MarkedYAMLError)
            if cause is None:
                raise
            raise WorkflowError(yaml_error_message(configpath_or_obj, cause)) from None

    load_with_position._klstudy = True
    configfile._load_configfile = load_with_position
