"""MkDocs hooks for SpecECD's documentation site (``hooks:`` in mkdocs.yml).

Three jobs, so that the site cannot drift from the code or silently lose a link:

- **The CLI reference.** A page holding the marker ``<!-- spececd-cli-reference -->`` gets
  it replaced by every ``spececd`` command's usage, description and options, rendered from
  the real argparse parser (:func:`spececd.cli.build_parser`) at build time.
- **Links that leave docs/.** Pages link to repository files (``../deploy/nginx.conf``) so
  that they read on GitHub; the site has no copy of those files, so such a link becomes
  its text and the path in code. A link to a repository file that does not exist is
  reported as a warning, which ``mkdocs build --strict`` turns into a failure.
- **Sphinx roles in docstrings.** The docstrings say ``:class:`Name```; the API reference
  shows the name alone.

The hooks import ``spececd`` from this checkout's ``src/`` (put first on ``sys.path``), not
from whatever copy is installed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.spececd_docs")

CLI_MARKER = "<!-- spececd-cli-reference -->"
USAGE_WIDTH = 88
# [text](target) or ![alt](target), target without a scheme; an optional "title" after it
LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)", re.MULTILINE)
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):(?=<code>)")
MARKDOWN_SPECIAL = re.compile(r"([\\*_\[\]<>|#])")


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    src = Path(config.config_file_path).resolve().parent / "src"
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    return config


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return rewrite_outside_links(markdown, page, config)


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return SPHINX_ROLE.sub("", html)


# -- links to repository files outside docs/ ------------------------------------------------


def rewrite_outside_links(markdown: str, page: Page, config: MkDocsConfig) -> str:
    """Turn links that leave docs/ into plain text naming the file; warn on missing ones."""
    docs_dir = Path(config.docs_dir).resolve()
    repo = docs_dir.parent
    page_dir = (docs_dir / page.file.src_path).parent

    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        if "://" in target or target.startswith(("#", "mailto:", "/")):
            return match[0]
        path_part = target.split("#", 1)[0]
        resolved = (page_dir / path_part).resolve()
        if resolved.is_relative_to(docs_dir):
            return match[0]  # mkdocs validates it
        relative = resolved.relative_to(repo).as_posix() if resolved.is_relative_to(repo) \
            else path_part
        if not resolved.exists():
            log.warning("%s links to %r, which is not in the repository: fix the link",
                        page.file.src_path, target)
            return match[0]
        if match["bang"]:
            log.warning("%s shows the image %r from outside docs/: move the image under "
                        "docs/", page.file.src_path, target)
            return match[0]
        text = match["text"]
        return f"`{relative}`" if text.strip("`") == relative else f"{text} (`{relative}`)"

    return "".join(
        part if fenced else LINK.sub(replace, part) for part, fenced in split_fences(markdown)
    )


def split_fences(markdown: str) -> Iterator[tuple[str, bool]]:
    """The text in pieces, each marked whether it lies inside a fenced code block."""
    inside = False
    start = 0
    for match in FENCE.finditer(markdown):
        yield markdown[start:match.start()], inside
        start = match.start()
        inside = not inside
    yield markdown[start:], inside


# -- the CLI reference ------------------------------------------------------------------------


def cli_reference() -> str:
    # imported by name, from this checkout's src/ (see on_config), when the page is built
    cli = importlib.import_module("spececd.cli")
    parser: argparse.ArgumentParser = cli.build_parser()
    return "\n".join(render_parser(parser, parser.prog, summary=None, depth=2))


def render_parser(parser: argparse.ArgumentParser, name: str, summary: str | None,
                  depth: int) -> Iterator[str]:
    parser.formatter_class = wide_formatter
    yield f"{'#' * depth} `{name}`"
    yield ""
    for text in (summary, parser.description):
        if text:
            yield escape(text)
            yield ""
    yield "```text"
    yield parser.format_usage().strip()
    yield "```"
    yield ""
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS
                   and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if not actions:
            continue
        yield f"**{escape(group.title or 'options')}**"
        yield ""
        yield "| option | meaning |"
        yield "| --- | --- |"
        for action in actions:
            yield f"| {option_names(action)} | {option_help(formatter, action)} |"
        yield ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for sub_name, sub_parser in action.choices.items():
                yield from render_parser(sub_parser, f"{name} {sub_name}",
                                         helps.get(sub_name), depth + 1)


def wide_formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=USAGE_WIDTH)


def option_names(action: argparse.Action) -> str:
    if not action.option_strings:  # a positional argument
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        metavar = ""
    elif action.choices is not None:
        metavar = " {" + ",".join(str(c) for c in action.choices) + "}"
    else:
        metavar = f" {action.metavar or action.dest.upper()}"
    return ", ".join(f"`{option}{metavar}`" for option in action.option_strings)


def option_help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    text = formatter._expand_help(action) if action.help else ""
    return escape(" ".join(text.split())) or "&nbsp;"


def escape(text: str) -> str:
    """Markdown-escape prose, leaving `code spans` as they are."""
    pieces = text.split("`")
    if len(pieces) % 2 == 0:  # an unpaired backtick: no code spans to keep
        return MARKDOWN_SPECIAL.sub(r"\\\1", text).replace("`", "\\`")
    return "`".join(piece if odd else MARKDOWN_SPECIAL.sub(r"\\\1", piece)
                    for odd, piece in ((i % 2 == 1, p) for i, p in enumerate(pieces)))
