"""The documentation is tested like code: README.md and docs/**/*.md.

- docs/reference.md is what `training/command_reference.py` renders from the code now (`make docs` rewrites it);
- every ```python block runs, each file's blocks in order in one namespace, in an empty folder, offline;
- every command the docs name exists, with every `--flag` given to it, checked against the parser the command
  builds (`hf-linear-attn-*`, `python training/NAME.py`, `python -m hf_linear_attn.training.NAME`,
  `python -m benchmarks.NAME`); a flag standing alone in an inline code span must be a flag of some command;
- every `make TARGET` is a target of the Makefile, every `python -m MODULE` an importable module;
- every repository path (`configs/...`, `training/...`, `docs/...`, ...) exists, and every link between files
  reaches a file and, with a `#fragment`, one of its headings.
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

from hf_linear_attn.training import command_reference
from hf_linear_attn.training.command_reference import Command

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
REFERENCE = ROOT / "docs" / "reference.md"
IDS = [str(path.relative_to(ROOT)) for path in DOCS]
# Flags that the docs name on their own and no documented command takes: other tools' (vLLM, accelerate, pip).
FOREIGN_FLAGS = {"--enforce-eager", "--trust-remote-code", "--config_file", "--num_processes", "--machine_rank",
                 "--kv-cache-memory-bytes", "--gpu-memory-utilization", "--no-deps"}
PATH_ROOTS = ("configs", "training", "docs", "benchmarks", "tests", "hf_linear_attn")

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?<![\w/.-])(?:hf-linear-attn-(?P<cli>[a-z-]+)(?:\s+(?P<sub>[a-z]+))?"
                     r"|(?P<script>(?:training|benchmarks)/\w+)\.py"
                     r"|-m\s+(?P<module>(?:hf_linear_attn\.training|benchmarks)\.\w+))")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
MAKE = re.compile(r"(?<![\w-])make\s+([a-z][\w-]*)")
PYTHON_MODULE = re.compile(r"(?<![\w-])-m\s+([A-Za-z_][\w.]*)")
REPO_PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(PATH_ROOTS)})/[^\s`'\"()\[\],;:]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def without_fences(text: str) -> str:
    return FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)


def code_texts(text: str) -> list[str]:
    """The code of a Markdown text: every fenced block and every inline code span outside them."""
    return [match.group(2) for match in FENCE.finditer(text)] + INLINE.findall(without_fences(text))


def command_line(code: str, start: int) -> str:
    """The arguments of the command that starts at `start`: up to the end of its line (a line ending in a
    backslash continues it) or a shell separator or comment."""
    end = start
    while end < len(code):
        char = code[end]
        if char == "\n" and not code[:end].rstrip(" ").endswith("\\"):
            break
        if char in ";|&)" or code.startswith(" #", end):
            break
        end += 1
    return code[start:end]


@cache
def commands() -> dict[tuple[str, str | None], Command]:
    """Every documented command by (module, sub-command)."""
    return {(command.module, command.subcommand): command for command in command_reference.all_commands()}


@cache
def flags_of(module: str, subcommand: str | None) -> set[str]:
    found = [command for (name, sub), command in commands().items()
             if name == module and (subcommand is None or sub == subcommand)]
    return set().union(*(command_reference.command_flags(command) for command in found))


@cache
def deprecated_of(module: str, subcommand: str | None) -> dict[str, str]:
    """`--old`: `--new` of the renamed flags the command still reads (with a warning): the docs use the new names."""
    found = [command for (name, sub), command in commands().items()
             if name == module and (subcommand is None or sub == subcommand)]
    return {old: new for command in found
            for old, new in command_reference.deprecated_flags(command_reference.command_parser(command)).items()}


@cache
def every_flag() -> set[str]:
    return set().union(*(flags_of(module, sub) for module, sub in commands()))


def command_uses(text: str) -> list[tuple[str, str | None, str]]:
    """(module, sub-command, arguments) of every command of this project in the code of `text`; an unknown
    `hf-linear-attn-*` name or sub-command fails here."""
    by_name = {command.invocation: command for command in commands().values()}
    uses = []
    for code in code_texts(text):
        for match in COMMAND.finditer(code):
            if match["cli"]:
                name = f"hf-linear-attn-{match['cli']}"
                known = [command for command in by_name.values() if command.invocation.split()[0] == name]
                assert known, f"{name}: no such command; the commands: {sorted(by_name)}"
                module = known[0].module
                subs = {command.subcommand for command in known} - {None}
                sub = match["sub"] if subs else None
                if subs:
                    assert sub in subs, f"{name} {match['sub']}: its sub-commands are {sorted(subs)}"
                args_start = match.end() if subs else match.end("cli")
            else:
                dotted = match["module"] or match["script"].replace("/", ".")
                module = dotted.replace("training.", "hf_linear_attn.training.", 1) if dotted.startswith(
                    "training.") else dotted
                if not any(name == module for name, _ in commands()):
                    continue  # a library module's path, checked as a path
                sub, args_start = None, match.end()
            uses.append((module, sub, command_line(code, args_start)))
    return uses


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z][\w. -]*?)\s*:(?!=)", line)
        if match:
            targets |= set(match.group(1).split())
    return targets


def heading_slugs(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub writes them."""
    slugs, seen = set(), {}
    for heading in HEADING.findall(without_fences(path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def is_placeholder(path: str) -> bool:
    """A path with a part to fill in: `benchmarks/NAME.py`, `training/<name>.py`, `ops_triton_*.py`."""
    return any(re.fullmatch(r"[A-Z][A-Z_]+(\.\w+)?|.*[<>{}*].*", part) for part in path.split("/"))


def test_the_reference_is_what_the_code_renders():
    assert REFERENCE.is_file(), "docs/reference.md is missing: run `make docs`"
    assert REFERENCE.read_text() == command_reference.render(), (
        "docs/reference.md differs from what training/command_reference.py renders from the code: run `make docs`")


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    blocks = [(match.group(2), path.read_text()[: match.start()].count("\n") + 2)
              for match in FENCE.finditer(path.read_text()) if match.group(1) == "python"]
    if not blocks:
        pytest.skip("no python block")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for code, line in blocks:
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_commands_and_flags_exist(path):
    text = path.read_text()
    wrong = []
    for module, sub, args in command_uses(text):
        accepted = flags_of(module, sub)
        wrong += [f"{module}{' ' + sub if sub else ''} {flag}" for flag in FLAG.findall(args) if flag not in accepted]
        if path.name != "reference.md":  # the reference lists the deprecated names; everything else uses the new
            wrong += [f"{module} {flag} (deprecated: {deprecated_of(module, sub)[flag]})" for flag in FLAG.findall(args)
                      if flag in deprecated_of(module, sub)]
    for span in INLINE.findall(without_fences(text)):
        if span.startswith("--"):
            flag = FLAG.match(span).group(0)
            if flag not in every_flag() | FOREIGN_FLAGS:
                wrong.append(f"{flag} (named alone: no command takes it)")
    assert not wrong, f"{path.name} names flags no parser accepts: {wrong}"


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_make_targets_and_modules_exist(path):
    code = "\n".join(code_texts(path.read_text()))
    targets = makefile_targets()
    missing = [f"make {target}" for target in MAKE.findall(code) if target not in targets]
    modules = [module.rstrip(".") for module in PYTHON_MODULE.findall(code)]
    missing += [f"python -m {module}" for module in modules
                if not is_placeholder(module.replace(".", "/")) and importlib.util.find_spec(module) is None]
    assert not missing, f"{path.name} names what does not exist: {missing}"


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_paths_and_links_exist(path):
    text = path.read_text()
    missing = []
    for code in code_texts(text):
        for found in REPO_PATH.findall(code):
            found = found.rstrip(".")
            if not (ROOT / found).exists() and not is_placeholder(found):
                missing.append(found)
    for target in LINK.findall(without_fences(text)):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            missing.append(target)
        elif fragment and fragment not in heading_slugs(linked):
            missing.append(f"{target} (no such heading in {linked.relative_to(ROOT)})")
    assert not missing, f"{path.name} names paths or links that do not exist: {missing}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """Each check fails on a made-up name: a flag, a command, a target, a path, a heading."""
    text = ("```bash\nhf-linear-attn-convert --model_name_or_path A --no_such_flag 1\nmake no-such-target\n```\n"
            "See `configs/no_such.yaml` and [x](docs/design.md#no-such-heading).\n")
    (module, sub, args), = command_uses(text)
    assert "--no_such_flag" in FLAG.findall(args) and "--no_such_flag" not in flags_of(module, sub)
    assert "--model_name_or_path" in flags_of(module, sub)
    with pytest.raises(AssertionError, match="no such command"):
        command_uses("`hf-linear-attn-nonesuch --x`")
    assert "no-such-target" not in makefile_targets() and "demo" in makefile_targets()
    assert not (ROOT / REPO_PATH.findall(text)[0]).exists()
    assert "no-such-heading" not in heading_slugs(ROOT / "docs" / "design.md")
    assert is_placeholder("benchmarks/NAME.py") and not is_placeholder("configs/demo.yaml")
