"""The examples of README.md, of every page of docs/ and of benchmarks/README.md work for a
newcomer, checked without running them: every `decoderlm` command line (also under torchrun or
`python -m decoderlm`) parses with the real command's flags and values; every `benchmarks/`
script exists and takes the flags given; every path given to a path flag exists in a fresh
clone or is made by an earlier command (`--out DIR`, a run's default `runs/NAME`, `mkdir`,
`curl -o`, `> FILE`, a settings file shown as `# NAME.yaml:` at the top of a block); `path/to/`
marks a path of the reader's. Each page is read after the README, on its own: it may use what
the README's commands make and must make the rest itself. Every Python example compiles and
every name it imports from decoderlm exists.
"""

import ast
import contextlib
import importlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from decoderlm.cli import COMMANDS, parse

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _in_a_fresh_clone() -> set[str]:
    """The files git tracks and their folders: what a fresh clone holds (a reader's own runs
    and data, made by following the pages, are not in it)."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return {str(parent) for f in files for parent in [Path(f), *Path(f).parents]} - {"."}


IN_A_FRESH_CLONE = _in_a_fresh_clone()
# the pages read after the README: the guide and the benchmarks' figures
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "benchmarks" / "README.md"]
PATH_FLAGS = {
    "--data",
    "--run",
    "--resume",
    "--config",
    "--model-config",
    "--hf",
    "--gguf",
    "--prompt-file",
    "--init-from",
    "--text-file",
}
OPERATORS = {"&&", "||", ";", "|", "&"}
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SETTINGS_FILE = re.compile(r"#\s*(\S+\.(?:ya?ml|json|toml))\s*:")


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return BLOCK.findall(text)


def shell_commands(body: str) -> list[list[str]]:
    """The simple commands of a shell block: words, with `> FILE` kept as two words; lines
    ending in a backslash are joined; comments dropped."""
    commands: list[list[str]] = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for word in lexer:
            if word in OPERATORS:
                commands.append(words)
                words = []
            else:
                words.append(word)
        commands.append(words)
    return [c for c in commands if c]


def decoderlm_argv(words: list[str]) -> list[str] | None:
    """The arguments after `decoderlm` of a command line that runs decoderlm, else None."""
    if words[0] == "decoderlm":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "decoderlm":
            return words[i + 2 :]
    return None


class Walk:
    """A page's commands in order, with the paths made so far and the problems found."""

    def __init__(self, made: set[str] | None = None):
        self.made: set[str] = set(made or ())
        self.problems: list[str] = []

    def known(self, path: str) -> bool:
        clean = path.rstrip("/")
        if "path/to/" in path:
            return True
        if str(Path(clean)) in IN_A_FRESH_CLONE:  # in the repository itself, not beside it
            return True
        return any(clean == p or clean.startswith(p + "/") for p in self.made)

    def shell(self, words: list[str]) -> None:
        for i, word in enumerate(words[:-1]):
            if word in (">", ">>") or (words[0] == "curl" and word in ("-o", "--output")):
                self.made.add(words[i + 1].rstrip("/"))
        if words[0] == "mkdir":
            self.made.update(w.rstrip("/") for w in words[1:] if not w.startswith("-"))
        words = words[: words.index(">")] if ">" in words else words
        argv = decoderlm_argv(words)
        if argv is not None:
            self.decoderlm(argv, shlex.join(words))
        elif (
            len(words) > 1 and words[0].startswith("python") and words[1].startswith("benchmarks/")
        ):
            self.benchmark(words[1], words[2:])

    def decoderlm(self, argv: list[str], line: str) -> None:
        if not argv or (argv[0] not in COMMANDS and argv[0] not in ("--version", "--help")):
            self.problems.append(f"{line}: no such decoderlm command")
            return
        parse_argv = []
        i = 0
        while i < len(argv):
            flag = argv[i].split("=", 1)[0]
            value = argv[i].split("=", 1)[1] if "=" in argv[i] else None
            if flag in PATH_FLAGS:
                value = value if value is not None else argv[i + 1]
                if not self.known(value):
                    self.problems.append(
                        f"{line}: {flag} {value} is neither in the repository "
                        f"nor made by an earlier README command"
                    )
                skip = 1 if "=" in argv[i] else 2
                if flag == "--config" and not (ROOT / value).is_file():  # shown in a block
                    i += skip
                    continue
                parse_argv += argv[i : i + skip]
                i += skip
                continue
            parse_argv.append(argv[i])
            i += 1
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # --help, --version
                command, given = parse(parse_argv)
        except SystemExit as e:  # --help, --version
            if e.code != 0:
                self.problems.append(f"{line}: exits {e.code}")
            return
        except Exception as e:  # noqa: BLE001 - every parse error is a README problem
            self.problems.append(f"{line}: {str(e).splitlines()[0]}")
            return
        self.record_outputs(command, given)

    def record_outputs(self, command: str, given: dict) -> None:
        out = given.get("out")
        if out:
            self.made.add(str(out).rstrip("/"))
        elif command == "train" and not given.get("resume"):
            self.made.add(f"runs/{given.get('preset') or 'default'}")

    def benchmark(self, script: str, args: list[str]) -> None:
        path = ROOT / script
        if not path.is_file():
            self.problems.append(f"{script}: no such benchmark script")
            return
        source = path.read_text(encoding="utf-8")
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and f'"{flag}"' not in source:
                self.problems.append(f"{script} {' '.join(args)}: {flag} is not one of its flags")
            if flag == "--data" and "=" not in arg:
                value = args[args.index(arg) + 1]
                if not self.known(value):
                    self.problems.append(f"{script}: --data {value} is not made by the README")


def python_problems(body: str) -> list[str]:
    """What is wrong with a Python example: a syntax error, or a name imported from decoderlm
    that does not exist (the example is compiled and its imports resolved, not run)."""
    try:
        tree = ast.parse(body)
    except SyntaxError as e:
        return [f"python example: {e}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("decoderlm"):
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                problems.append(f"python example: no module {node.module}")
                continue
            problems += [
                f"python example: {node.module} has no {alias.name}"
                for alias in node.names
                if not hasattr(module, alias.name)
            ]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("decoderlm"):
                    try:
                        importlib.import_module(alias.name)
                    except ImportError:
                        problems.append(f"python example: no module {alias.name}")
    return problems


def walk(text: str, made: set[str] | None = None) -> Walk:
    """Read a page's blocks in order, starting from the paths in `made`."""
    state = Walk(made)
    for language, body in readme_blocks(text):
        if language == "python":
            state.problems += python_problems(body)
        elif language in ("yaml", "yml", "json", "toml"):
            match = SETTINGS_FILE.match(body.strip())
            if match:
                state.made.add(match.group(1))
        elif language in ("bash", "sh", "shell", "console"):
            for words in shell_commands(body):
                state.shell(words)
    return state


def test_every_readme_command_parses_and_its_paths_exist_or_are_made_before():
    state = walk(README.read_text(encoding="utf-8"))
    assert not state.problems, "\n".join(state.problems)


@pytest.fixture(scope="module")
def made_by_readme() -> set[str]:
    return walk(README.read_text(encoding="utf-8")).made


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_of_a_page_parses_after_the_readme(page, made_by_readme):
    state = walk(page.read_text(encoding="utf-8"), made_by_readme)
    assert not state.problems, "\n".join(state.problems)


def test_the_pages_are_there_and_none_points_outside_the_repository():
    names = {p.name for p in PAGES if p.parent.name == "docs"}
    assert {"index.md", "training.md", "data.md", "models.md", "sampling.md", "lens.md"} <= names
    assert {"finetune.md", "huggingface.md", "testing.md"} <= names
    for page in [README, *PAGES]:
        assert "../shared" not in page.read_text(encoding="utf-8"), page


@pytest.mark.parametrize(
    "example,problem",
    [
        ("decoderlm train --n-layerz 2", "n-layerz"),
        ("decoderlm trian", "no such decoderlm command"),
        ("decoderlm sample --run runs/nowhere", "runs/nowhere"),
        ("decoderlm train --data ../shared/data/x.txt", "../shared"),  # not in a fresh clone
        ("decoderlm eval --run runs/x --split test", "split"),
        ("python benchmarks/nowhere.py", "no such benchmark"),
        ("python benchmarks/train_speed.py --parts all", "--parts is not one of its flags"),
        ("torchrun --nproc_per_node 2 -m decoderlm train --dtyp bf16", "dtyp"),
    ],
)
def test_the_checker_finds_a_drifted_example(example, problem):
    state = walk(f"```bash\n{example}\n```\n")
    assert state.problems and problem in state.problems[0], state.problems


@pytest.mark.parametrize(
    "example,problem",
    [
        ("from decoderlm import DecoderLN", "decoderlm has no DecoderLN"),
        ("from decoderlm.model.hooks import hook", "decoderlm.model.hooks has no hook"),
        ("import decoderlm.nowhere", "no module decoderlm.nowhere"),
        ("from decoderlm.nowhere import x", "no module decoderlm.nowhere"),
        ("x = (", "python example"),
    ],
)
def test_the_checker_finds_a_drifted_python_example(example, problem):
    state = walk(f"```python\n{example}\n```\n")
    assert state.problems and problem in state.problems[0], state.problems


def test_a_page_starts_from_what_the_readme_made():
    page = "```bash\ndecoderlm sample --run runs/default\n```\n"
    assert walk(page, {"runs/default"}).problems == []
    assert "runs/default" in walk(page).problems[0]


def test_the_checker_follows_what_earlier_commands_make():
    text = (
        "```bash\nmkdir -p data/x\nhead -n 3 README.md > data/x/train.txt\n"
        "decoderlm prepare --data data/x --out data/x-char\n"
        "decoderlm train --data data/x-char --out runs/x\ndecoderlm sample --run runs/x\n"
        "decoderlm train --preset seed-notebook\ndecoderlm eval --run runs/seed-notebook\n```\n"
        "```yaml\n# mine.yaml: decoderlm train --config mine.yaml\nmax_steps: 3\n```\n"
        "```bash\ndecoderlm train --config mine.yaml \\\n   --max-steps 4   # a comment\n```\n"
    )
    state = walk(text)
    assert not state.problems, state.problems
    assert {"data/x", "data/x-char", "runs/x", "runs/seed-notebook", "mine.yaml"} <= state.made
